"""Prometheus metrics of our models, exported through Triton's metrics port (`/metrics`).

All three models export the engine's counters under the same names (`EngineCounters`), so a
scraper gets rates (tokens/s), waste and occupancy of every scheme over any window: waste =
1 - d(generation_tokens) / d(rows_computed) (rows that made no token: prompt rows before a
prompt's last, padding rows of finished members), occupancy = d(sequence_rows) / d(slot_steps)
(sequences computed per sequence the cap allowed). `llm_inflight` adds gauges and latency
histograms, updated from its sender thread, never from the engine's stepping thread.

The same values go out under the names vLLM exports too (`vllm:num_requests_waiting`, ... with a
`model_name` label), so that dashboards, autoscalers and routers written for vLLM read these
models unchanged (`VLLM_NAMES`).
"""

from __future__ import annotations

from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.sequence import RequestOutput
from tritonllm.metric_names import VLLM_LABELS, VLLM_NAMES
from tritonllm.engine.model_loader import dtype_name
from tritonllm.triton.pb import pb_utils

MODEL_INFO = "tritonllm_model_info"

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]
TOKEN_GAP_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0]


def export_model_info(model_name: str, engine: LLMEngine) -> list:
    """`tritonllm_model_info{model, dtype, device, quantization} 1`: what a model really runs (dtype `auto` resolved),
    for the launcher's banner and the load test's report. Keep the returned objects alive."""
    family = pb_utils.MetricFamily(name=MODEL_INFO, description="What the model runs (labels); always 1",
                                   kind=pb_utils.MetricFamily.GAUGE)
    runner = engine.runner
    metric = family.Metric(labels={"model": model_name, "dtype": dtype_name(runner.dtype),
                                   "device": runner.device.type, "quantization": runner.quantization})
    metric.set(1)
    return [family, metric]


class _Twins:
    """One of our metrics and its vLLM-named twin, updated together."""

    def __init__(self, *metrics):
        self.metrics = metrics

    def set(self, value) -> None:
        for m in self.metrics:
            m.set(value)

    def increment(self, value) -> None:
        for m in self.metrics:
            m.increment(value)

    def observe(self, value) -> None:
        for m in self.metrics:
            m.observe(value)


# (EngineStats field, counter, description): the engine's cumulative stats, exported alike by every scheme.
ENGINE_COUNTERS = [
    ("prompt_tokens", "tritonllm_prompt_tokens_total", "Prompt tokens prefilled"),
    ("tokens_generated", "tritonllm_generation_tokens_total", "Tokens generated"),
    ("decode_steps", "tritonllm_steps_total", "Engine steps that generated tokens"),
    ("rows_computed", "tritonllm_rows_computed_total", "Token rows computed by forwards (prompt, decode and padding rows)"),
    ("padding_rows", "tritonllm_padding_rows_total", "Rows of finished batch members kept as padding"),
    ("sequence_rows", "tritonllm_sequence_rows_total", "Sequences in forwards, summed (padding members included)"),
    ("slot_steps", "tritonllm_slot_steps_total", "Cap on sequences (max_num_seqs) x forwards: the sequences the cap "
     "allowed"),
    ("requests_scheduled", "tritonllm_requests_scheduled_total", "Requests that got their first forward"),
    ("queue_seconds", "tritonllm_request_queue_seconds_total", "Seconds requests waited in the engine before their "
     "first forward (summed)"),
    ("preemptions", "tritonllm_num_preemptions_total", "Sequences preempted for KV blocks (recomputed later)"),
    ("prefix_cache_queries", "tritonllm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
    ("prefix_cache_hits", "tritonllm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not computed)"),
]


class EngineCounters:
    """The engine's cumulative stats as counters; the same for every scheme."""

    def __init__(self, model_name: str, engine: LLMEngine):
        self.engine = engine
        self.families = []  # a family must outlive its metrics
        Family = pb_utils.MetricFamily  # set by the stub after model.py is imported: look it up here
        self.labels = labels = {"model": model_name}
        self.counters = {stat: self._metric(name, description, Family.COUNTER, labels)  # engine stat -> counter
                         for stat, name, description in ENGINE_COUNTERS}
        self.seen = {name: 0 for name in self.counters}
        # Load tools wait for it to be 0 on every model before a run (a cut-off client's request still runs).
        self.open = self._metric("tritonllm_num_requests_open", "Requests accepted and not yet given their final "
                                 "response (running, waiting or being sent)", Family.GAUGE, labels)
        self.info = export_model_info(model_name, engine)

    def _family(self, name, description, kind) -> list:
        """Our family and, where vLLM has one alike, its twin: families must outlive their metrics."""
        names = [name] + ([VLLM_NAMES[name]] if name in VLLM_NAMES else [])
        families = [pb_utils.MetricFamily(name=n, description=description, kind=kind) for n in names]
        self.families += families
        return families

    @staticmethod
    def _in_family(families, labels, **options):
        """A metric of every family given, each with its own label names."""
        metrics = [families[0].Metric(labels=labels, **options)]
        metrics += [f.Metric(labels={VLLM_LABELS.get(k, k): v for k, v in labels.items()}, **options)
                    for f in families[1:]]
        return metrics[0] if len(metrics) == 1 else _Twins(*metrics)

    def _metric(self, name, description, kind, labels, **options):
        return self._in_family(self._family(name, description, kind), labels, **options)

    def update(self) -> None:
        stats = self.engine.stats
        for name, counter in self.counters.items():
            value = getattr(stats, name)
            if value > self.seen[name]:
                counter.increment(value - self.seen[name])
                self.seen[name] = value


class InflightMetrics(EngineCounters):
    def __init__(self, model_name: str, engine: LLMEngine):
        super().__init__(model_name, engine)
        Family, labels = pb_utils.MetricFamily, self.labels
        self.running = self._metric("tritonllm_num_requests_running", "Sequences in the running batch", Family.GAUGE, labels)
        self.waiting = self._metric("tritonllm_num_requests_waiting", "Requests waiting for a slot", Family.GAUGE, labels)
        self.finished_families = self._family("tritonllm_request_finished_total", "Requests finished, by "
                                              "finish_reason (stop, length, abort: cancelled or shut down, error)",
                                              Family.COUNTER)
        self.finished = {}  # finish_reason -> counter, made when first seen
        # (running + waiting) / slots is the replica's saturation: what deploy/k8s's autoscaler watches.
        self.slots = self._metric("tritonllm_num_slots", "Sequences the engine runs at once (max_num_seqs)",
                                  Family.GAUGE, labels)
        self.slots.set(engine.config.max_num_seqs)
        self.kv_usage = self._metric("tritonllm_kv_cache_usage_ratio", "KV cache blocks in use (0-1)", Family.GAUGE, labels)
        self.kv_blocks_used = self._metric("tritonllm_kv_cache_blocks_used", "KV cache blocks held by sequences",
                                           Family.GAUGE, labels)
        self.kv_blocks = self._metric("tritonllm_kv_cache_blocks", "KV cache blocks of the pool "
                                      f"({engine.config.block_size} tokens each)", Family.GAUGE, labels)
        self.kv_blocks.set(engine.scheduler.blocks.num_usable)
        self.occupancy = self._metric("tritonllm_occupancy_ratio", "Sequences computed / sequences the cap "
                                      "allowed, over every forward since start", Family.GAUGE, labels)
        self.ttft = self._histogram("tritonllm_time_to_first_token_seconds", "Time to first token", labels, LATENCY_BUCKETS)
        self.tpot = self._histogram("tritonllm_time_per_output_token_seconds", "Time per output token after the first",
                                    labels, TOKEN_GAP_BUCKETS)
        self.e2e = self._histogram("tritonllm_e2e_request_latency_seconds", "Arrival to last token", labels, LATENCY_BUCKETS)

    def _histogram(self, name, description, labels, buckets):
        if not hasattr(pb_utils.MetricFamily, "HISTOGRAM"):  # Triton before 24.07
            return None
        return self._metric(name, description, pb_utils.MetricFamily.HISTOGRAM, labels, buckets=buckets)

    def update_gauges(self, num_open: int) -> None:
        self.update()
        stats = self.engine.stats
        running = self.engine.num_running
        self.running.set(running)
        self.waiting.set(self.engine.num_waiting)
        self.open.set(num_open)
        blocks = self.engine.scheduler.blocks
        self.kv_usage.set(blocks.usage)
        self.kv_blocks_used.set(blocks.num_usable - blocks.num_free)
        self.occupancy.set(stats.occupancy)

    def observe_finished(self, out: RequestOutput) -> None:
        reason = out.finish_reason or "unknown"
        if reason not in self.finished:
            self.finished[reason] = self._in_family(self.finished_families, {**self.labels, "finish_reason": reason})
        self.finished[reason].increment(1)
        if self.ttft is None or out.first_token_time is None:
            return
        last = out.token_times[-1] if out.token_times else out.first_token_time
        self.ttft.observe(out.first_token_time - out.arrival_time)
        self.e2e.observe(last - out.arrival_time)
        if out.num_output_tokens > 1:
            self.tpot.observe((last - out.first_token_time) / (out.num_output_tokens - 1))
