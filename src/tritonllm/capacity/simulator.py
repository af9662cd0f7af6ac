"""A discrete-event simulation of the three batching schemes on a virtual clock.

- In-flight: each replica drives the engine's real `Scheduler` (continuous policy), one step after
  another; a step lasts what the step-cost model says for its chunks, and at its end every
  sampling chunk adds a token, as `LLMEngine` does.
- Dynamic and static: each replica has a queue that follows Triton's dynamic batcher (from the
  model's config.pbtxt: max batch size, preferred batch size, max queue delay, max queue size).
  When the model is free it dispatches once the queue holds a preferred batch, or once the oldest
  request has waited the queue delay; the batch then runs through the real `Scheduler` with the
  request policy (finished rows stay as padding) and every request of it is answered at its end.

Replicas share nothing; a router sends each arrival to one (round robin, or least loaded: fewest
requests not yet answered). Outputs are per request: arrival, first token, end.
"""

from __future__ import annotations

import heapq
import itertools
import math
import re
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tritonllm.capacity.step_cost import StepCost
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import Scheduler, SchedulerConfig
from tritonllm.engine.sequence import Sequence
from tritonllm.server.repository import DEFAULT_MODEL_REPOSITORY as REPOSITORY
from tritonllm.server.repository import read_config


@dataclass
class SimRequest:
    index: int
    arrival: float
    prompt_tokens: int
    max_tokens: int
    started: float | None = None  # its batch or its first forward began
    first_token: float | None = None
    end: float | None = None
    rejected: bool = False  # refused by a full queue
    replica: int = -1
    token_times: list[float] | None = None  # every token's time, when the replica records them (calibration)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        return None if self.end is None or self.rejected else self.end - self.arrival


@dataclass(frozen=True)
class BatcherConfig:
    """Triton's dynamic batcher settings of one model."""

    max_batch_size: int
    max_queue_delay_s: float
    preferred_batch_size: int | None = None  # None: max_batch_size
    max_queue_size: int = 0  # 0: unbounded
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    @property
    def target(self) -> int:
        return self.preferred_batch_size or self.max_batch_size


def batcher_config(model: str, repository: Path = REPOSITORY) -> BatcherConfig:
    text, params = read_config(model, repository)

    def number(pattern: str, default: float | None = None) -> float | None:
        m = re.search(pattern, text)
        return float(m.group(1)) if m else default

    preferred = re.search(r"preferred_batch_size:\s*\[\s*(\d+)", text)
    return BatcherConfig(max_batch_size=int(number(r"max_batch_size:\s*(\d+)")),
                         max_queue_delay_s=number(r"max_queue_delay_microseconds:\s*(\d+)", 0) / 1e6,
                         preferred_batch_size=int(preferred.group(1)) if preferred else None,
                         max_queue_size=int(number(r"max_queue_size:\s*(\d+)", 0)),
                         max_num_batched_tokens=int(params.get("max_num_batched_tokens", 2048)),
                         max_model_len=int(params.get("max_model_len", 2048)))


def engine_config(model: str = "llm_inflight", repository: Path = REPOSITORY) -> tuple[SchedulerConfig, int]:
    """The in-flight engine's scheduler config and its queue bound (max_queue_size, 0: unbounded)."""
    _, params = read_config(model, repository)
    return SchedulerConfig.from_parameters(params), int(params.get("max_queue_size", 0))


def _sequence(req: SimRequest) -> Sequence:
    return Sequence(str(req.index), [req.index] * req.prompt_tokens,  # its own tokens: no prefix-cache hit
                    SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True))


def apply_step(scheduler: Scheduler, chunks, on_token) -> None:
    """What a forward does to the scheduled sequences (as LLMEngine._run): computed tokens advance, every
    sampling chunk adds a token, a sequence at its max_tokens finishes (`on_token(seq, finished)`)."""
    for c in chunks:
        if c.padding:
            continue
        scheduler.advance(c)
        if c.samples:
            c.seq.output_ids.append(0)
            done = len(c.seq.output_ids) >= c.seq.params.max_tokens
            if done:
                scheduler.finish(c.seq, "length")
            on_token(c.seq, done)


class InflightReplica:
    """One llm_inflight: the real scheduler, stepping back to back while it has work."""

    def __init__(self, config: SchedulerConfig, cost: StepCost, max_queue_size: int = 0, record_tokens: bool = False):
        self.scheduler = Scheduler(config)
        self.cost, self.max_queue_size, self.record_tokens = cost, max_queue_size, record_tokens
        self.requests: dict[Sequence, SimRequest] = {}
        self.step_end = math.inf
        self.chunks = []

    @property
    def load(self) -> int:
        return len(self.requests)

    def next_event(self) -> float:
        return self.step_end

    def accept(self, req: SimRequest, now: float) -> list[SimRequest]:
        """Take a request; returns it if it was refused (answered at once)."""
        if self.max_queue_size and self.scheduler.num_waiting >= self.max_queue_size:
            req.rejected, req.end = True, now
            return [req]
        seq = _sequence(req)
        self.scheduler.add(seq)
        self.requests[seq] = req
        if self.step_end == math.inf:  # idle: the engine thread wakes at once
            self._start(now)
        return []

    def advance(self, now: float) -> list[SimRequest]:
        """End the running step; returns the requests it finished."""
        done_now = []

        def on_token(seq, done):
            req = self.requests[seq]
            if req.first_token is None:
                req.first_token = now
            if self.record_tokens:
                req.token_times = req.token_times or []
                req.token_times.append(now)
            if done:
                req.end = now
                done_now.append(self.requests.pop(seq))
        apply_step(self.scheduler, self.chunks, on_token)
        self._start(now)
        return done_now

    def _start(self, now: float) -> None:
        self.chunks = self.scheduler.schedule()
        for c in self.chunks:
            req = self.requests.get(c.seq)
            if req is not None and req.started is None:
                req.started = now
        self.step_end = now + self.cost.seconds(self.chunks) if self.chunks else math.inf


class BatchedReplica:
    """One llm_dynamic / llm_static: Triton's dynamic batcher in front of request-level batches."""

    def __init__(self, batcher: BatcherConfig, cost: StepCost):
        self.batcher, self.cost = batcher, cost
        self.queue: deque[SimRequest] = deque()
        self.batch: list[SimRequest] = []
        self.batch_end = math.inf
        self.dispatch_at = math.inf

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.batch)

    def next_event(self) -> float:
        return min(self.batch_end, self.dispatch_at)

    def accept(self, req: SimRequest, now: float) -> list[SimRequest]:
        """Queue a request; returns it if the queue was full (refused at once)."""
        b = self.batcher
        if b.max_queue_size and len(self.queue) >= b.max_queue_size:
            req.rejected, req.end = True, now
            return [req]
        self.queue.append(req)
        if not self.batch:
            self._plan(now)
        return []

    def advance(self, now: float) -> list[SimRequest]:
        """End the running batch and/or dispatch the next; returns the requests answered."""
        done_now = []
        if self.batch and now >= self.batch_end:
            for req in self.batch:  # answered together when the batch ends
                req.first_token = req.end = self.batch_end
            done_now, self.batch, self.batch_end = self.batch, [], math.inf
            self._plan(now)
        if not self.batch and now >= self.dispatch_at:
            self._dispatch(now)
        return done_now

    def _plan(self, now: float) -> None:
        if not self.queue:
            self.dispatch_at = math.inf
        elif len(self.queue) >= self.batcher.target:
            self.dispatch_at = now
        else:
            self.dispatch_at = max(now, self.queue[0].arrival + self.batcher.max_queue_delay_s)

    def _dispatch(self, now: float) -> None:
        b = self.batcher
        n = min(len(self.queue), b.max_batch_size)
        self.batch = [self.queue.popleft() for _ in range(n)]
        for req in self.batch:
            req.started = now
        self.dispatch_at = math.inf
        self.batch_end = now + self.run_batch([r.prompt_tokens for r in self.batch],
                                              [r.max_tokens for r in self.batch])

    def run_batch(self, prompts: list[int], outputs: list[int]) -> float:
        """Seconds a request-level batch runs: the real scheduler's steps until its longest member ends."""
        b = self.batcher
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=b.max_batch_size, max_model_len=b.max_model_len,
                                              max_num_batched_tokens=b.max_num_batched_tokens,
                                              batch_policy="request"))
        for i, (p, n) in enumerate(zip(prompts, outputs)):
            scheduler.add(_sequence(SimRequest(i, 0.0, p, n)))
        seconds = 0.0
        while True:
            chunks = scheduler.schedule()
            if not chunks:
                return seconds
            seconds += self.cost.seconds(chunks)
            apply_step(scheduler, chunks, lambda seq, done: None)


def make_replicas(scheme: str, replicas: int, cost: StepCost, repository: Path = REPOSITORY,
                  record_tokens: bool = False) -> list:
    if scheme == "inflight":
        config, queue = engine_config("llm_inflight", repository)
        return [InflightReplica(config, cost, queue, record_tokens) for _ in range(replicas)]
    batcher = batcher_config(f"llm_{scheme}", repository)
    return [BatchedReplica(batcher, cost) for _ in range(replicas)]


def simulate(requests: list[SimRequest], replicas: list, routing: str = "least-loaded",
             on_done: Callable[[SimRequest], SimRequest | None] | None = None) -> list[SimRequest]:
    """Run the requests through the replicas; returns every request simulated, times filled in.
    `on_done(req)` may return a new request when one is answered (a closed loop's next request)."""
    if routing not in ("round-robin", "least-loaded"):
        raise ValueError(f"routing must be round-robin or least-loaded, got {routing!r}")
    everything = list(requests)
    arrivals = [(r.arrival, r.index, r) for r in requests]
    heapq.heapify(arrivals)
    events: list[tuple[float, int, int]] = []  # (time, sequence number, replica); superseded ones are skipped
    seq = itertools.count()
    scheduled = [math.inf] * len(replicas)
    robin = itertools.cycle(range(len(replicas)))

    def answered(done: list[SimRequest]) -> None:
        for req in done:
            new = on_done(req) if on_done is not None else None
            if new is not None:
                everything.append(new)
                heapq.heappush(arrivals, (new.arrival, new.index, new))

    while True:
        while events and events[0][0] != scheduled[events[0][2]]:
            heapq.heappop(events)
        t_arrival = arrivals[0][0] if arrivals else math.inf
        t_event = events[0][0] if events else math.inf
        if t_arrival == math.inf and t_event == math.inf:
            return everything
        if t_arrival <= t_event:
            req = heapq.heappop(arrivals)[2]
            k = next(robin) if routing == "round-robin" else min(range(len(replicas)), key=lambda j: replicas[j].load)
            req.replica = k
            answered(replicas[k].accept(req, t_arrival))
        else:
            _, _, k = heapq.heappop(events)
            scheduled[k] = math.inf
            answered(replicas[k].advance(t_event))
        t = replicas[k].next_event()
        if t != scheduled[k]:
            scheduled[k] = t
            if t != math.inf:
                heapq.heappush(events, (t, next(seq), k))


def closed_loop(first: list[SimRequest], make: Callable[[int, float], SimRequest | None], gap_s: float = 0.0):
    """`on_done` for `users` closed-loop users: each answered request is followed, `gap_s` later (the
    client's answer and next request on their way), by the next index (`make(index, time)`, None once
    the run has all its requests)."""
    counter = itertools.count(len(first))

    def on_done(req: SimRequest) -> SimRequest | None:
        return make(next(counter), req.end + gap_s)
    return on_done
