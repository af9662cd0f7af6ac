"""Numbers of one run, from its raw samples (exact percentiles) and its metric scrapes.

Throughput is vLLM benchmark_serving's definition: output tokens of the finished requests over
the span from the first request's start to the last one's end. Requests cut off by the end of a
run (`interrupted`) count neither as finished nor as errors.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tritonllm_loadtest.metrics_scraper import delta, load_scrapes, series
from tritonllm_loadtest.samples import Sample, load_samples

STREAMING_PROTOCOLS = ("grpc-stream", "http-sse", "openai-sse")
SCHEME_OF_MODEL = {"llm_inflight": "inflight", "llm_dynamic": "dynamic", "llm_static": "static"}


@dataclass
class RunInfo:
    """What was run (run.json in the run's directory)."""

    name: str
    scheme: str
    model: str
    user_class: str = ""
    protocol: str = ""
    concurrency: int = 0
    arrival_rate: float = 0.0
    max_requests: int = 0
    run_time_s: float = 0.0
    started: float = 0.0
    ended: float = 0.0
    locust_rc: int | None = None
    server_cpu_s: float | None = None  # CPU seconds the server's processes used during the run (when known)
    workload: str = ""
    command: list[str] = field(default_factory=list)

    def save(self, run_dir: str | Path) -> None:
        Path(run_dir, "run.json").write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, run_dir: str | Path) -> "RunInfo":
        """run.json, or what the samples say when there is none (a plain `locust` run)."""
        run_dir = Path(run_dir)
        path = run_dir / "run.json"
        if path.exists():
            row = json.loads(path.read_text())
            return cls(**{k: v for k, v in row.items() if k in cls.__dataclass_fields__})
        samples = load_samples(run_dir)
        if not samples:
            raise ValueError(f"{run_dir}: no run.json and no samples*.jsonl")
        first = samples[0]
        return cls(name=run_dir.name, scheme=SCHEME_OF_MODEL.get(first.model, first.model), model=first.model,
                   user_class=first.user, protocol=first.protocol, concurrency=max(s.users for s in samples))


def percentile(values, q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


@dataclass
class RunSummary:
    name: str
    scheme: str
    model: str
    protocol: str
    concurrency: int
    arrival_rate: float
    streaming: bool
    planned: int  # requests the run was to send (its --max-requests; 0: unbounded)
    finished: int  # ok + errors
    ok: int
    errors: int
    interrupted: int
    error_rate: float | None
    duration_s: float | None
    output_tokens: int
    tokens_per_s: float | None
    requests_per_s: float | None
    offered_rps: float | None  # open loop: the arrivals' own rate, (n - 1) / their span (`keeping_up`)
    sustained_rps: float | None  # open loop: answered in the arrival window shifted by the median latency, per s
    keep_up_floor_rps: float | None  # open loop: the least sustained rate that is keeping up
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    e2e_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    tpot_p50: float | None
    normalized_latency: float | None  # mean of e2e / output tokens (s per token)
    late_p90: float | None  # open loop: how late requests were sent after their arrival time
    queue_wait_s: float | None  # mean wait before a request's batch or slot starts: Triton's queue + the engine's
    triton_queue_s: float | None  # mean Δnv_inference_queue_duration_us / Δnv_inference_request_success
    engine_queue_s: float | None  # mean wait in the engine before the first forward
    server_cpu_s: float | None
    core_s_per_1k_tokens: float | None  # server CPU seconds per 1,000 output tokens
    gpu_s_per_1k_tokens: float | None  # ∫ nv_gpu_utilization dt per 1,000 output tokens (on a GPU)
    goodput_rps: float | None  # finished requests/s that met both SLOs
    slo_ttft_s: float
    slo_tpot_s: float
    waste: float | None  # 1 - d(tokens) / d(rows computed): rows that made no token (prompt rows before the last, padding)
    occupancy: float | None  # d(sequence rows) / d(slot steps): sequences computed per sequence the cap allowed
    padding_share: float | None  # d(padding rows) / d(rows computed): finished members kept in a batch
    triton_batch_size: float | None  # Triton's d(inference_count) / d(exec_count) over the run
    engine_steps: float | None = None  # Δtritonllm_steps_total: forwards that sampled tokens
    ms_per_step: float | None = None  # the run's duration / its engine steps
    top_errors: list[tuple[str, int]] = field(default_factory=list)


KEEP_UP = 0.9  # a server keeps up when it sustains this share of the offered rate (less the count's noise)


def keeping_up(samples: list[Sample], ok: list[Sample], rate: float) -> dict:
    """Whether an open-loop point's server kept up with its arrivals, as rates over the arrival window W
    (first to last arrival; a sample's start is when it was due): offered = (n - 1) / W; sustained =
    answers that came within W shifted by the median end-to-end latency, / W (so a short window's
    latency does not read as falling behind, and a growing queue does); the floor = (KEEP_UP (n - 1) -
    sqrt(n - 1)) / W: KEEP_UP of the offered, less one standard deviation of a count of n - 1
    (heavy-tailed lengths move single answers across the window's edges)."""
    none = {"offered_rps": None, "sustained_rps": None, "keep_up_floor_rps": None}
    arrivals = sorted(s.start for s in samples)
    if not rate or len(arrivals) < 2 or arrivals[-1] <= arrivals[0] or not ok:
        return none
    first, last, n = arrivals[0], arrivals[-1], len(arrivals)
    window = last - first
    shift = float(np.median([s.e2e for s in ok]))
    answered = sum(first + shift <= s.start + s.e2e <= last + shift for s in ok)
    return {"offered_rps": (n - 1) / window, "sustained_rps": answered / window,
            "keep_up_floor_rps": max(0.0, KEEP_UP * (n - 1) - math.sqrt(n - 1)) / window}


def computed_rows(scrapes: list[dict], model: str) -> tuple[float | None, float | None, float | None]:
    """(waste, occupancy, padding share) of a model over the scrapes, from its own counters."""
    def d(name):
        return delta(scrapes, series(f"tritonllm_{name}_total", model=model))

    rows, tokens, padding = d("rows_computed"), d("generation_tokens"), d("padding_rows")
    sequences, slots = d("sequence_rows"), d("slot_steps")
    return (1 - tokens / rows if rows and tokens is not None else None,
            sequences / slots if slots and sequences is not None else None,
            padding / rows if rows and padding is not None else None)


def summarize(info: RunInfo, samples: list[Sample], scrapes: list[dict] | None = None,
              slo_ttft_s: float = 2.0, slo_tpot_s: float = 0.5) -> RunSummary:
    ok = [s for s in samples if s.ok]
    errors = [s for s in samples if s.error is not None and not s.interrupted]
    interrupted = [s for s in samples if s.interrupted]
    done = ok + errors
    duration = None
    if done:
        duration = max(s.end for s in done) - min(s.start for s in done)
        duration = duration if duration > 0 else None
    tokens = sum(s.output_tokens for s in ok)
    itl = [g for s in ok for g in s.itl]
    streaming = (info.protocol or (samples[0].protocol if samples else "")) in STREAMING_PROTOCOLS

    def meets_slo(s: Sample) -> bool:  # a non-streaming answer has no TPOT: all its tokens come at once
        return (s.ttft is not None and s.ttft <= slo_ttft_s) and (
            not streaming or s.tpot is None or s.tpot <= slo_tpot_s)

    waste = occupancy = padding = batch = triton_queue = engine_queue = gpu_seconds = steps = None
    if scrapes:
        steps = delta(scrapes, series("tritonllm_steps_total", model=info.model))
        d_queue_us = delta(scrapes, series("nv_inference_queue_duration_us", model=info.model, version="1"))
        d_success = delta(scrapes, series("nv_inference_request_success", model=info.model, version="1"))
        if d_queue_us is not None and d_success:
            triton_queue = d_queue_us / 1e6 / d_success
        d_engine_s = delta(scrapes, series("tritonllm_request_queue_seconds_total", model=info.model))
        d_scheduled = delta(scrapes, series("tritonllm_requests_scheduled_total", model=info.model))
        if d_engine_s is not None and d_scheduled:
            engine_queue = d_engine_s / d_scheduled
        gpu_seconds = gpu_busy_seconds(scrapes)
        waste, occupancy, padding = computed_rows(scrapes, info.model)
        d_count = delta(scrapes, series("nv_inference_count", model=info.model, version="1"))
        d_exec = delta(scrapes, series("nv_inference_exec_count", model=info.model, version="1"))
        if d_count is not None and d_exec and not info.scheme.startswith("inflight"):  # the in-flight engine batches by itself
            batch = d_count / d_exec
    return RunSummary(
        name=info.name, scheme=info.scheme, model=info.model, protocol=info.protocol,
        concurrency=info.concurrency, arrival_rate=info.arrival_rate, streaming=streaming,
        planned=info.max_requests, finished=len(done), ok=len(ok), errors=len(errors), interrupted=len(interrupted),
        error_rate=len(errors) / len(done) if done else None, duration_s=duration, output_tokens=tokens,
        tokens_per_s=tokens / duration if duration else None,
        requests_per_s=len(ok) / duration if duration else None,
        **keeping_up(samples, ok, info.arrival_rate),
        ttft_p50=percentile([s.ttft for s in ok], 50), ttft_p90=percentile([s.ttft for s in ok], 90),
        ttft_p99=percentile([s.ttft for s in ok], 99),
        e2e_p50=percentile([s.e2e for s in ok], 50), e2e_p90=percentile([s.e2e for s in ok], 90),
        e2e_p99=percentile([s.e2e for s in ok], 99),
        itl_p50=percentile(itl, 50), itl_p90=percentile(itl, 90), itl_p99=percentile(itl, 99),
        tpot_p50=percentile([s.tpot for s in ok], 50) if streaming else None,
        normalized_latency=float(np.mean([s.e2e / s.output_tokens for s in ok if s.output_tokens]))
        if any(s.output_tokens for s in ok) else None,
        late_p90=percentile([s.late for s in ok], 90),
        queue_wait_s=None if triton_queue is None and engine_queue is None else (triton_queue or 0) + (engine_queue or 0),
        triton_queue_s=triton_queue, engine_queue_s=engine_queue, server_cpu_s=info.server_cpu_s,
        core_s_per_1k_tokens=1000 * info.server_cpu_s / tokens if info.server_cpu_s is not None and tokens else None,
        gpu_s_per_1k_tokens=1000 * gpu_seconds / tokens if gpu_seconds and tokens else None,
        goodput_rps=sum(map(meets_slo, ok)) / duration if duration else None,
        slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
        waste=waste, occupancy=occupancy, padding_share=padding, triton_batch_size=batch,
        engine_steps=steps, ms_per_step=1000 * duration / steps if duration and steps else None,
        top_errors=Counter(s.error for s in errors).most_common(3),
    )


def gpu_busy_seconds(scrapes: list[dict]) -> float | None:
    """∫ nv_gpu_utilization dt summed over the GPUs (None without GPU metrics)."""
    total, seen = 0.0, False
    for prev, cur in zip(scrapes, scrapes[1:]):
        for key, util in cur["values"].items():
            if key.startswith("nv_gpu_utilization"):
                seen = True
                total += util * (cur["time"] - prev["time"])
    return total if seen else None


def summarize_run_dir(run_dir: str | Path, **slo) -> tuple[RunInfo, list[Sample], list[dict], RunSummary]:
    run_dir = Path(run_dir)
    info = RunInfo.load(run_dir)
    samples = load_samples(run_dir)
    scrapes = load_scrapes(run_dir / "metrics.jsonl")
    return info, samples, scrapes, summarize(info, samples, scrapes, **slo)


@dataclass
class Ratio:
    concurrency: int
    arrival_rate: float
    baseline: str  # the scheme in-flight is compared with
    tokens_per_s: float | None  # in-flight / baseline: > 1 means in-flight produced more
    ttft_p50: float | None  # in-flight / baseline: < 1 means in-flight answered first sooner
    e2e_p90: float | None
    requests_per_s: float | None
    error_rate_inflight: float | None
    error_rate_baseline: float | None


def _div(a, b):
    return a / b if a is not None and b else None


def ratios(summaries: list[RunSummary], scheme: str = "inflight") -> list[Ratio]:
    """In-flight against every other scheme run at the same load (concurrency and arrival rate)."""
    out = []
    for s in summaries:
        if s.scheme != scheme:
            continue
        for b in summaries:
            if b.scheme == scheme or (b.concurrency, b.arrival_rate) != (s.concurrency, s.arrival_rate):
                continue
            out.append(Ratio(s.concurrency, s.arrival_rate, b.scheme, _div(s.tokens_per_s, b.tokens_per_s),
                             _div(s.ttft_p50, b.ttft_p50), _div(s.e2e_p90, b.e2e_p90),
                             _div(s.requests_per_s, b.requests_per_s), s.error_rate, b.error_rate))
    return out
