"""Scrape Triton's Prometheus endpoint during a run: llm_inflight's engine counters and gauges,
and Triton's own per-model inference/execution counts.

Over a scrape interval, waste is 1 - d(tritonllm_generation_tokens_total) /
d(tritonllm_rows_computed_total) (rows computed that made no token) and occupancy
d(tritonllm_sequence_rows_total) / d(tritonllm_slot_steps_total) (sequences computed per sequence
the cap allowed).
Triton's average batch size over an interval is d(nv_inference_count) / d(nv_inference_exec_count).

    python -m tritonllm_loadtest.metrics_scraper http://127.0.0.1:8002/metrics --out m.jsonl --duration 60
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# Families kept from each scrape (histogram buckets are left out; _sum/_count are kept).
KEEP = re.compile(r"^(tritonllm_\w+?(?<!_bucket)|nv_inference_(count|exec_count|request_success|request_failure"
                  r"|queue_duration_us|compute_infer_duration_us|pending_request_count)|nv_cpu_utilization|nv_gpu_utilization)$")
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str, keep: re.Pattern | None = KEEP) -> dict[str, float]:
    """{'name{label="v",...}': value} for the samples of the text exposition format (labels sorted)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3) or "", m.group(4)
        if keep is not None and not keep.match(name):
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        pairs = sorted(_LABEL.findall(labels))
        key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else "")
        out[key] = number
    return out


def series(name: str, **labels: str) -> str:
    """The key parse_prometheus uses for one series."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_prometheus(resp.read().decode("utf-8", "replace"))


BUSY_GAUGES = ("nv_inference_pending_request_count", "tritonllm_num_requests_open")  # queued; accepted, not answered


def busy_models(values: dict[str, float]) -> dict[str, float]:
    """The series of a scrape that say a model still has requests queued or in hand (value > 0)."""
    return {k: v for k, v in values.items() if v > 0 and k.split("{", 1)[0] in BUSY_GAUGES}


def wait_until_idle(url: str, timeout: float, poll: float = 0.5) -> tuple[float, dict[str, float]]:
    """Wait until no model of the server has a request queued or in hand: requests whose client gave
    up (a run's cut-off ones) still run on the server and would take the next run's CPU. Returns the
    seconds waited and what was still busy at the end ({} when idle, or no metrics to read)."""
    t0 = time.monotonic()
    while True:
        try:
            busy = busy_models(scrape(url))
        except OSError:  # no metrics endpoint: nothing to wait on
            return time.monotonic() - t0, {}
        if not busy or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, busy
        time.sleep(poll)


class MetricsScraper:
    """A background thread appending one JSON line per scrape: {"time": epoch, "values": {...}}."""

    def __init__(self, url: str, out: str | Path, interval: float = 1.0):
        self.url, self.out, self.interval = url, Path(out), interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.scrapes = 0
        self.errors = 0
        self.last_error: str | None = None

    def start(self) -> "MetricsScraper":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="metrics-scraper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        with open(self.out, "a", encoding="utf-8") as f:
            next_at = time.monotonic()
            while not self._stop.is_set():
                row: dict = {"time": time.time()}
                try:
                    row["values"] = scrape(self.url, timeout=max(1.0, self.interval))
                    self.scrapes += 1
                except (OSError, ValueError) as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"
                    self.errors += 1
                    self.last_error = row["error"]
                f.write(json.dumps(row) + "\n")
                f.flush()
                next_at += self.interval
                self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def __enter__(self) -> "MetricsScraper":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def load_scrapes(path: str | Path) -> list[dict]:
    """The successful scrapes of a file written by MetricsScraper, oldest first."""
    rows = []
    path = Path(path)
    if not path.exists():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if "values" in row:
                rows.append(row)
    return sorted(rows, key=lambda r: r["time"])


@dataclass
class IntervalPoint:
    time: float  # end of the interval (epoch seconds)
    waste: float | None  # 1 - d(generation tokens) / d(rows computed); None when no row was computed
    occupancy: float | None  # d(sequence rows) / d(slot steps); None when no forward ran
    tokens_per_s: float  # generated tokens per second in the interval
    running: float | None
    waiting: float | None


def interval_points(scrapes: list[dict], model: str = "llm_inflight") -> list[IntervalPoint]:
    """Per-interval waste, occupancy and token rate of a model from consecutive scrapes."""
    gen = series("tritonllm_generation_tokens_total", model=model)
    rows = series("tritonllm_rows_computed_total", model=model)
    sequences = series("tritonllm_sequence_rows_total", model=model)
    slots = series("tritonllm_slot_steps_total", model=model)
    running = series("tritonllm_num_requests_running", model=model)
    waiting = series("tritonllm_num_requests_waiting", model=model)
    points = []
    for prev, cur in zip(scrapes, scrapes[1:]):
        a, b = prev["values"], cur["values"]
        if any(k not in b for k in (gen, rows, sequences, slots)):
            continue
        d = {k: b[k] - a.get(k, 0.0) for k in (gen, rows, sequences, slots)}
        dt = cur["time"] - prev["time"]
        points.append(IntervalPoint(cur["time"], 1 - d[gen] / d[rows] if d[rows] > 0 else None,
                                    d[sequences] / d[slots] if d[slots] > 0 else None,
                                    d[gen] / dt if dt > 0 else 0.0, b.get(running), b.get(waiting)))
    return points


def delta(scrapes: list[dict], key: str) -> float | None:
    """Last minus first value of a counter over the scrapes (None if it never appeared)."""
    values = [s["values"][key] for s in scrapes if key in s["values"]]
    return values[-1] - values[0] if len(values) >= 2 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Scrape Triton's metrics into a JSON-lines file.")
    p.add_argument("url", help="e.g. http://127.0.0.1:8002/metrics")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--duration", type=float, required=True, help="seconds to scrape")
    args = p.parse_args(argv)
    with MetricsScraper(args.url, args.out, args.interval) as scraper:
        time.sleep(args.duration)
    print(f"{scraper.scrapes} scrapes ({scraper.errors} failed) -> {args.out}")
    return 0 if scraper.scrapes else 1


if __name__ == "__main__":
    raise SystemExit(main())
