"""The load test's workload replayed through the simulator: its requests as simulated ones, a scheme run
open or closed loop, and what the load test would have measured of the result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonllm.capacity.simulator import REPOSITORY, SimRequest, closed_loop, make_replicas, simulate
from tritonllm.capacity.step_cost import StepCost
from tritonllm_loadtest.arrivals import ArrivalSchedule
from tritonllm_loadtest.summary import percentile
from tritonllm_loadtest.workload import Workload

SCHEMES = ("inflight", "dynamic", "static")


class RequestSource:
    """Request i of the load test's workload as the simulator needs it: prompt tokens and max_tokens."""

    def __init__(self, workload: Workload, tokenizer=None):
        self.workload, self.tokenizer = workload, tokenizer
        self._prompt_tokens: dict[str, int] = {}

    def make(self, index: int, arrival: float) -> SimRequest:
        spec = self.workload.request(index)
        return SimRequest(index, arrival, self.prompt_tokens(spec.prompt), spec.max_tokens)

    def prompt_tokens(self, prompt: str) -> int:
        if prompt not in self._prompt_tokens:  # the engine encodes the prompt as given (llm_engine.add_request)
            self._prompt_tokens[prompt] = (len(self.tokenizer.encode(prompt)) if self.tokenizer is not None
                                           else max(1, round(1.3 * len(prompt.split()))))
        return self._prompt_tokens[prompt]

    def open_loop(self, rate: float, n: int, seed: int) -> list[SimRequest]:
        schedule = ArrivalSchedule(rate, seed)
        return [self.make(i, schedule.at(i)) for i in range(n)]


@dataclass
class Predicted:
    """What a simulated run would have measured (the load test's definitions)."""

    requests: int
    answered: int
    tokens_per_s: float | None
    ttft_p50: float | None
    ttft_p90: float | None
    e2e_p90: float | None
    normalized_latency: float | None

    @classmethod
    def of(cls, reqs: list[SimRequest]) -> "Predicted":
        ok = [r for r in reqs if r.e2e is not None]
        span = (max(r.end for r in ok) - min(r.arrival for r in ok)) if ok else 0.0
        tokens = sum(r.max_tokens for r in ok)
        return cls(len(reqs), len(ok), tokens / span if span > 0 else None,
                   percentile([r.ttft for r in ok], 50), percentile([r.ttft for r in ok], 90),
                   percentile([r.e2e for r in ok], 90),
                   float(np.mean([r.e2e / r.max_tokens for r in ok])) if ok else None)


def run_scheme(scheme: str, reqs: list[SimRequest], cost: StepCost, replicas: int = 1, routing: str = "least-loaded",
               users: int = 0, source: RequestSource | None = None, total: int = 0,
               overhead_s: float = 0.0, record_tokens: bool = False, repository: Path = REPOSITORY
               ) -> tuple[list[SimRequest], list]:
    """Simulate requests (open loop), or `users` closed-loop users over `total` requests from `source`;
    `overhead_s` is what each request spends outside the engine (client, gRPC, Triton, the stub): added
    to what its client sees (first token and end), and to a closed-loop user's wait for its next request.
    `repository`: the model repository whose config.pbtxt files the replicas follow."""
    reps = make_replicas(scheme, replicas, cost, repository, record_tokens)
    on_done = None
    if users:
        on_done = closed_loop(reqs, lambda i, now: source.make(i, now) if i < total else None, overhead_s)
    done = simulate(reqs, reps, routing, on_done)
    for r in done:
        if r.end is not None and not r.rejected:
            r.first_token += overhead_s
            r.end += overhead_s
    return done, reps
