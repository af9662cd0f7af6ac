"""The front's own Prometheus metrics (`GET /metrics`): requests, errors, latency, time to first token.

The models' metrics (tokens, slots, queue) stay on Triton's metrics port; these say what the
front adds and what its clients saw. Written in the text exposition format by hand: a few
counters and histograms need no client library.
"""

from __future__ import annotations

import math
from collections import defaultdict

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...]):
        self.name, self.help, self.labels = name, help, labels
        self.values: dict[tuple[str, ...], float] = defaultdict(float)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] += amount

    def lines(self) -> list[str]:
        return [f"{self.name}{_labels(self.labels, k)} {_number(v)}" for k, v in sorted(self.values.items())]


class Gauge(Counter):
    kind = "gauge"

    def dec(self, *labels: str) -> None:
        self.values[labels] -= 1


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: tuple[str, ...], buckets=LATENCY_BUCKETS):
        self.name, self.help, self.labels, self.buckets = name, help, labels, tuple(buckets)
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = defaultdict(float)

    def observe(self, value: float, *labels: str) -> None:
        counts = self.counts.setdefault(labels, [0] * (len(self.buckets) + 1))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        self.sums[labels] += value

    def lines(self) -> list[str]:
        out = []
        for key, counts in sorted(self.counts.items()):
            for bound, count in zip((*self.buckets, math.inf), counts):
                le = 'le="' + _number(bound) + '"'
                out.append(f"{self.name}_bucket{_labels(self.labels, key, le)} {count}")
            out.append(f"{self.name}_sum{_labels(self.labels, key)} {self.sums[key]!r}")
            out.append(f"{self.name}_count{_labels(self.labels, key)} {counts[-1]}")
        return out


class FrontMetrics:
    def __init__(self):
        self.requests = Counter("tritonllm_openai_requests_total",
                                "Requests answered by the OpenAI front, by route, model and HTTP status",
                                ("endpoint", "model", "status"))
        self.errors = Counter("tritonllm_openai_request_errors_total",
                              "Requests that ended in an error (also those whose stream had begun), by type",
                              ("endpoint", "model", "type"))
        self.cancelled = Counter("tritonllm_openai_requests_cancelled_total",
                                 "Requests whose client went away before the answer ended (cancelled upstream)",
                                 ("endpoint", "model"))
        self.running = Gauge("tritonllm_openai_requests_running", "Generation requests in progress in the front",
                             ("model",))
        self.latency = Histogram("tritonllm_openai_request_duration_seconds",
                                 "Time from a request's arrival to its last byte", ("endpoint", "model"))
        self.ttft = Histogram("tritonllm_openai_time_to_first_token_seconds",
                              "Time from a streaming request's arrival to its first text", ("model",))
        self.prompt_tokens = Counter("tritonllm_openai_prompt_tokens_total", "Prompt tokens of answered requests",
                                     ("model",))
        self.completion_tokens = Counter("tritonllm_openai_completion_tokens_total",
                                         "Completion tokens of answered requests", ("model",))

    def render(self) -> str:
        out = []
        for metric in (self.requests, self.errors, self.cancelled, self.running, self.latency, self.ttft,
                       self.prompt_tokens, self.completion_tokens):
            out.append(f"# HELP {metric.name} {metric.help}")
            out.append(f"# TYPE {metric.name} {metric.kind}")
            out += metric.lines()
        return "\n".join(out) + "\n"
