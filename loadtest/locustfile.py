"""Locust users for the three LLM models of this repository (Triton's vLLM-backend contract).

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --grpc-url 127.0.0.1:8001 \
        --headless -u 8 -r 8 -t 60s GrpcStreamUser

User classes (one protocol each; the model is the class default or --triton-model):
  GrpcStreamUser  llm_inflight over gRPC bidirectional streaming: ttft, itl, tpot, e2e
  SseStreamUser   llm_inflight over HTTP generate_stream (server-sent events): ttft, itl, tpot, e2e
  GrpcInferUser   llm_dynamic / llm_static over unary gRPC infer: e2e (TTFT == e2e, no streaming)
  HttpInferUser   llm_dynamic / llm_static over HTTP /infer: e2e
  OpenAIStreamUser  any OpenAI-compatible server (llama.cpp's llama-server, vLLM, TGI) over streaming
                  /v1/completions at --host: ttft, itl, tpot, e2e (the same requests, for a side-by-side)

Each stage fires its own Locust request event (name ttft / itl / tpot / e2e, response_length =
output tokens), so it shows in Locust's UI, CSV and HTML; failures are counted once, on e2e.
Raw samples (one JSON line per request) go to --samples-file for exact percentiles; in
distributed runs the workers ship them to the master with their stats reports.
"""

from __future__ import annotations

import locust  # noqa: F401  (monkey-patches the standard library for gevent: first)

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any gRPC channel; without it streaming users record nothing

import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import gevent  # noqa: E402
import gevent.queue  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402
from gevent import GreenletExit  # noqa: E402
from locust import HttpUser, User, events, task  # noqa: E402
from locust.exception import StopUser  # noqa: E402
from locust.runners import WORKER_REPORT_INTERVAL, MasterRunner, WorkerRunner  # noqa: E402
from locust.stats import CSV_STATS_INTERVAL_SEC  # noqa: E402

from tritonllm_loadtest import protocol, shapes  # noqa: E402  (module, not classes: see shapes.py)
from tritonllm_loadtest.arrivals import ArrivalSchedule  # noqa: E402
from tritonllm_loadtest.samples import Measurement, Sample, SampleWriter  # noqa: E402
from tritonllm_loadtest.workload import (DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS,  # noqa: E402
                                         Workload, load_prompts)

log = logging.getLogger("tritonllm_loadtest")
SAMPLES_KEY = "tritonllm_samples"
ERROR_BACKOFF_S = 0.1  # pause of a user after a failed request  # key of the samples in worker -> master stats reports


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    g = parser.add_argument_group("tritonllm", "Workload and targets of the tritonllm load test")
    g.add_argument("--grpc-url", default="", env_var="LOCUST_GRPC_URL",
                   help="Triton gRPC address host:port (default: the --host's hostname, port 8001)")
    g.add_argument("--triton-model", default="", env_var="LOCUST_TRITON_MODEL",
                   help="Model to send to (default: llm_inflight for stream users, llm_dynamic for infer users)")
    g.add_argument("--output-tokens", default=DEFAULT_OUTPUT_TOKENS, env_var="LOCUST_OUTPUT_TOKENS",
                   help="Output length distribution: fixed:N, uniform:A:B, exp:MEAN:CAP[:MIN] (forced with "
                        "max_tokens + ignore_eos)")
    g.add_argument("--prompt-words", default=DEFAULT_PROMPT_WORDS, env_var="LOCUST_PROMPT_WORDS",
                   help="Prompt length in words: 'dataset' (prompts as written) or a distribution as above")
    g.add_argument("--shared-prefix-words", type=int, default=0, env_var="LOCUST_SHARED_PREFIX_WORDS",
                   help="Every prompt starts with the same text of this many words (a shared system prompt)")
    g.add_argument("--prompts-file", default="", env_var="LOCUST_PROMPTS_FILE",
                   help="JSON-lines prompt set (default: the shipped loadtest/prompts.jsonl)")
    g.add_argument("--workload-seed", type=int, default=0, env_var="LOCUST_WORKLOAD_SEED",
                   help="Seed: request i is the same for every model and run")
    g.add_argument("--temperature", type=float, default=0.0, env_var="LOCUST_TEMPERATURE",
                   help="Sampling temperature (0 = greedy); with > 0 each request carries its own seed")
    g.add_argument("--max-requests", type=int, default=0, env_var="LOCUST_MAX_REQUESTS",
                   help="Stop after this many finished requests (0: only -t bounds the run)")
    g.add_argument("--samples-file", default="samples.jsonl", env_var="LOCUST_SAMPLES_FILE",
                   help="Raw per-request samples (JSON lines; '' disables); written by the master/local runner")
    g.add_argument("--arrival-rate", type=float, default=0.0, env_var="LOCUST_ARRIVAL_RATE",
                   help="Open loop: Poisson arrivals at this total rate (req/s), request i sent at its seeded "
                        "arrival time whatever the server does; -u caps the requests in flight (an arrival that "
                        "finds every user busy is late, and its times count from when it was due). 0 = closed loop")
    parser.add_argument("--arrival-rate-per-worker", type=float, default=0.0, include_in_web_ui=False,
                        help="(set by the master: its --arrival-rate shared among the workers)")
    parser.add_argument("--max-requests-per-worker", type=int, default=0, include_in_web_ui=False,
                        help="(set by the master: its --max-requests shared among the workers)")
    g.add_argument("--openai-model", default="", env_var="LOCUST_OPENAI_MODEL",
                   help="OpenAIStreamUser: the `model` field of each request (default: left out)")
    g.add_argument("--request-timeout", type=float, default=600.0, env_var="LOCUST_REQUEST_TIMEOUT",
                   help="Seconds before a request counts as failed")
    g.add_argument("--shape", default="none", env_var="LOCUST_SHAPE", choices=["none", *shapes.SHAPES],
                   help="Load shape: none (-u/-r/-t), steps (concurrency sweep), spike, soak")
    g.add_argument("--shape-users", default="", env_var="LOCUST_SHAPE_USERS",
                   help="steps: user counts '1,2,4,8'; spike: 'BASE,PEAK'; soak: 'N'")
    g.add_argument("--shape-step-time", type=float, default=30.0, env_var="LOCUST_SHAPE_STEP_TIME",
                   help="steps: seconds per step")
    g.add_argument("--shape-time", type=float, default=0.0, env_var="LOCUST_SHAPE_TIME",
                   help="spike/soak: total seconds (default 90 / 3600)")
    g.add_argument("--spike-at", type=float, default=30.0, env_var="LOCUST_SPIKE_AT", help="spike: start (s)")
    g.add_argument("--spike-time", type=float, default=20.0, env_var="LOCUST_SPIKE_TIME",
                   help="spike: duration (s)")
    g.add_argument("--shape-ramp", type=float, default=10.0, env_var="LOCUST_SHAPE_RAMP",
                   help="soak: seconds to ramp up to its users")


class RunState:
    """Per-process state: the workload, request counters and where samples go."""

    def __init__(self):
        self.workload: Workload | None = None
        self.writer: SampleWriter | None = None
        self.buffer: list[str] = []  # samples waiting for the next report to the master (workers)
        self.issued = itertools.count()
        self.done = 0
        self.quitting = False
        self.arrivals: ArrivalSchedule | None = None  # open loop: when each request is due
        self.t0: float | None = None  # monotonic time of arrival offset 0

    def reset(self):
        self.issued = itertools.count()
        self.done = 0
        self.quitting = False
        self.arrivals = None
        self.t0 = None


STATE = RunState()


@events.init.add_listener
def _on_init(environment, runner, **_):
    _ENV["environment"] = environment
    opts = environment.parsed_options
    if opts is None:  # library use without a command line: defaults
        return
    if not isinstance(runner, WorkerRunner):
        shape = shapes.make_shape(opts)
        if shape is not None:
            shape.runner = runner
            environment.shape_class = shape
        if opts.samples_file:
            STATE.writer = SampleWriter(opts.samples_file)
    if isinstance(runner, MasterRunner):
        events.worker_report.add_listener(_on_worker_report)
    if isinstance(runner, WorkerRunner):
        events.report_to_master.add_listener(_on_report_to_master)


@events.test_start.add_listener
def _on_test_start(environment, **_):
    opts = environment.parsed_options
    STATE.reset()
    runner = environment.runner
    # test_start fires before the spawn messages, which carry the custom options to the workers.
    if isinstance(runner, MasterRunner) and opts is not None:
        workers = max(runner.worker_count, 1)
        opts.arrival_rate_per_worker = opts.arrival_rate / workers
        if opts.max_requests:
            opts.max_requests_per_worker = math.ceil(opts.max_requests / workers)
    if opts is not None:  # workers get the master's custom options with the spawn message
        STATE.workload = Workload(load_prompts(opts.prompts_file or None), opts.output_tokens, opts.prompt_words,
                                  opts.workload_seed, opts.temperature, shared_prefix_words=opts.shared_prefix_words)
        rate = opts.arrival_rate_per_worker or opts.arrival_rate
        if rate > 0 and not isinstance(runner, MasterRunner):
            STATE.arrivals = ArrivalSchedule(rate, opts.workload_seed, stream=max(runner.worker_index, 0))
    else:
        STATE.workload = Workload()
    log.info("workload: %s", STATE.workload.describe())


@events.quitting.add_listener
def _on_quitting(environment, **_):
    if STATE.writer is not None:
        log.info("%d samples written to %s", STATE.writer.count, STATE.writer.path)
        STATE.writer.close()


def _on_report_to_master(client_id, data, **_):
    data[SAMPLES_KEY], STATE.buffer = STATE.buffer, []


def _on_worker_report(client_id, data, **_):
    for line in data.get(SAMPLES_KEY, []):
        if json.loads(line).get("interrupted"):
            if STATE.writer is not None:
                STATE.writer.write_line(line)
        else:
            _count_done(_ENV["environment"], line)


_ENV = {}  # the Locust Environment, for listeners that are not handed it


def _count_done(environment, line: str):
    """A finished request (local runner, or a worker's report on the master): store, count, maybe stop."""
    if STATE.writer is not None:
        STATE.writer.write_line(line)
    STATE.done += 1
    opts = environment.parsed_options
    limit = opts.max_requests if opts is not None else 0
    if limit and STATE.done >= limit and not STATE.quitting:
        STATE.quitting = True
        log.info("%d requests finished (--max-requests): stopping", STATE.done)
        gevent.spawn(_stop_when_idle, environment)


def _stop_when_idle(environment, grace: float = 30.0):
    """End the run once the local users have stopped by themselves (StopUser after the last request):
    killing a user in the middle of its on_stop would leave its gRPC channel open and hang the exit.
    A master's users live on the workers: it stops them at once (their cut-off requests are dropped).

    Locust rewrites its CSV once a second and not at exit, and workers report every few seconds:
    wait for both before quitting, or the CSV misses the last requests."""
    runner = environment.runner
    opts = environment.parsed_options
    if isinstance(runner, MasterRunner):
        runner.stop()
        gevent.sleep(WORKER_REPORT_INTERVAL + CSV_STATS_INTERVAL_SEC + 0.5)
    else:
        deadline = time.monotonic() + grace
        while runner.user_count > 0 and time.monotonic() < deadline:
            gevent.sleep(0.05)
        if opts is not None and opts.csv_prefix:
            gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2)
    if opts is not None and opts.headless:
        runner.quit()
    else:
        runner.stop()


class TritonLLMUser:
    """What the four user classes share: the next request, the sample, the Locust events."""

    model = ""
    protocol = ""
    streams = False

    def _setup(self):
        opts = self.environment.parsed_options
        self.opts = opts
        self.target = (opts.triton_model if opts is not None and opts.triton_model else "") or self.model
        self.timeout = opts.request_timeout if opts is not None else 600.0
        self.request_type = f"{self.protocol} {self.target}"

    def wait_time(self):
        return 0  # closed loop: the next request at once; open loop: _begin waits for the request's arrival

    def _begin(self):
        """The next request of the workload (at its arrival time in an open loop) and its Measurement;
        StopUser once --max-requests are out."""
        opts = self.opts
        limit = (opts.max_requests_per_worker or opts.max_requests) if opts is not None else 0
        index = next(STATE.issued)
        if limit and index >= limit:
            raise StopUser()
        late = 0.0
        if STATE.arrivals is not None:
            due = self._arrival_clock() + STATE.arrivals.at(index)
            gevent.sleep(max(0.0, due - time.monotonic()))
            late = max(0.0, time.monotonic() - due)
        runner = self.environment.runner
        spec = STATE.workload.request(index, stream=max(runner.worker_index, 0))
        sample = Sample(model=self.target, user=type(self).__name__, protocol=self.protocol, index=index,
                        worker=max(runner.worker_index, 0), expected_tokens=spec.max_tokens,
                        prompt_id=spec.prompt_id, prompt_words=spec.prompt_words, users=runner.user_count)
        return spec, Measurement(sample, late=late, streams=self.streams)

    def _arrival_clock(self, patience: float = 30.0) -> float:
        """When arrival offset 0 is: once every user of this process has spawned (or after `patience`
        seconds), so that the first arrivals do not wait behind users still starting."""
        runner = self.environment.runner
        deadline = time.monotonic() + patience
        while STATE.t0 is None and runner.user_count < (runner.target_user_count or 0) \
                and time.monotonic() < deadline:
            gevent.sleep(0.01)
        if STATE.t0 is None:
            STATE.t0 = time.monotonic()
        return STATE.t0

    def _fire_stages(self, sample: Sample, fire_e2e: bool) -> None:
        if sample.interrupted:
            return  # cut off by the end of the run: kept in the samples, no Locust event
        if sample.error is not None:
            if fire_e2e:
                self._fire("e2e", sample.e2e or 0.0, sample.output_tokens, RuntimeError(sample.error))
            return
        if self.streams and sample.ttft is not None:  # None: a stream with no piece
            self._fire("ttft", sample.ttft, sample.output_tokens)
            for gap in sample.itl:
                self._fire("itl", gap, 1)
        if self.streams and sample.tpot is not None:
            self._fire("tpot", sample.tpot, sample.output_tokens)
        if fire_e2e:
            self._fire("e2e", sample.e2e, sample.output_tokens)

    def _fire(self, name, seconds, length, exception=None):
        self.environment.events.request.fire(request_type=self.request_type, name=name,
                                             response_time=seconds * 1000.0, response_length=length,
                                             exception=exception, context={})

    def _post_measured(self, path: str, body: dict, m, read, stream: bool = False) -> None:
        """POST to `path`; `read(resp, m)` takes the tokens and returns an error or None.
        The HTTP request's own Locust event becomes the e2e event."""
        try:
            with self.client.post(path, json=body, stream=stream,
                                  catch_response=True, name="e2e", timeout=self.timeout) as resp:
                sample = m.finish(_http_error(resp) if resp.status_code != 200 else read(resp, m))
                _as_e2e(resp, self.request_type, sample)
        except GreenletExit:
            self._record(m.interrupt(), fire_e2e=False)
            raise
        except Exception as exc:  # noqa: BLE001  (a broken stream: not reported by the with-block)
            self._record(m.finish(f"{type(exc).__name__}: {exc}"))  # fires the failed e2e itself
            return
        self._record(sample, fire_e2e=False)

    def _record(self, sample: Sample, fire_e2e: bool = True):
        """Locust events for each stage, then the raw sample (to the file, or to the master).
        The sample is counted whatever happens to the events: a lost sample would hold the run
        until its time bound (--max-requests counts samples)."""
        try:
            self._fire_stages(sample, fire_e2e)
        except Exception:  # noqa: BLE001
            log.exception("firing the Locust events of request %d failed", sample.index)
        line = sample.to_json()
        if sample.error is not None:
            gevent.sleep(ERROR_BACKOFF_S)  # a failing server is not hammered by a tight retry loop
        if isinstance(self.environment.runner, WorkerRunner):
            STATE.buffer.append(line)
        elif not sample.interrupted:
            _count_done(self.environment, line)
        elif STATE.writer is not None:
            STATE.writer.write_line(line)


class GrpcStreamUser(TritonLLMUser, User):
    """llm_inflight over gRPC bidirectional streaming: one stream (and client) per user."""

    model = "llm_inflight"
    protocol = "grpc-stream"
    streams = True

    def on_start(self):
        self._setup()
        url = self.opts.grpc_url if self.opts is not None and self.opts.grpc_url else default_grpc_url(self.host)
        self.client = grpcclient.InferenceServerClient(url)
        self.busy = False  # a request is in flight on the stream
        self.responses: gevent.queue.Queue | None = None  # the stream opens with the first request: an open-loop
        # run has more users than requests, and a stream that never carried a request keeps Triton 2.51 from
        # unloading the decoupled model at shutdown (it waits out its exit timeout)

    def _start_stream(self):
        self.responses = gevent.queue.Queue()
        queue = self.responses  # a restarted stream must not feed the new queue stale responses
        self.client.start_stream(callback=lambda result, error: queue.put((time.perf_counter(), result, error)))

    def on_stop(self):
        client, self.client = getattr(self, "client", None), None
        if client is not None:  # else the process does not exit
            # Cancel only a request still in flight (a user killed by the run's end): cancelling an idle
            # stream keeps Triton 2.51 from unloading the decoupled model at shutdown until its exit timeout.
            busy = self.busy
            _close(lambda: client.stop_stream(cancel_requests=busy), client.close)

    @task
    def generate(self):
        spec, m = self._begin()
        request_id = f"{id(self)}-{spec.index}"
        error = None
        try:
            if self.responses is None:
                self._start_stream()
            self.busy = True
            self.client.async_stream_infer(self.target, protocol.grpc_inputs(spec, stream=True, batched=False),
                                           outputs=protocol.grpc_outputs(), request_id=request_id,
                                           enable_empty_final_response=True)
            deadline = time.perf_counter() + self.timeout
            while True:
                try:
                    now, result, err = self.responses.get(timeout=max(0.0, deadline - time.perf_counter()))
                except gevent.queue.Empty:
                    error = f"no final response after {self.timeout:g} s"
                    break
                if err is not None:
                    error = f"{type(err).__name__}: {err}"
                    break
                if result.get_response().id != request_id:
                    continue  # a late response of an earlier request
                m.tokens(protocol.grpc_result_tokens(result), now)
                if protocol.grpc_is_final(result):
                    self.busy = False
                    break
        except GreenletExit:
            self._record(m.interrupt())
            raise
        except Exception as exc:  # noqa: BLE001  (any client failure is this request's error)
            error = f"{type(exc).__name__}: {exc}"
        self._record(m.finish(error))
        if error is not None:  # the stream may be broken or still carry this request: start afresh
            self.client.stop_stream(cancel_requests=True)
            self.responses, self.busy = None, False


class TritonHttpUser(TritonLLMUser, HttpUser):
    """What the HTTP users share: Triton's default HTTP address and the setup."""

    abstract = True
    host = "http://127.0.0.1:8000"

    def on_start(self):
        self._setup()


class SseStreamUser(TritonHttpUser):
    """llm_inflight over HTTP generate_stream (SSE). HttpUser, not FastHttpUser: its line iterator
    buffers 1 KiB and would inflate TTFT."""

    model = "llm_inflight"
    protocol = "http-sse"
    streams = True

    @task
    def generate(self):
        spec, m = self._begin()
        self._post_measured(f"/v2/models/{self.target}/generate_stream", protocol.generate_body(spec, stream=True),
                            m, self._read_events, stream=True)

    @staticmethod
    def _read_events(resp, m) -> str | None:
        for line in resp.iter_lines(chunk_size=None):
            event = protocol.parse_sse_line(line)
            if event is None:
                continue
            if "error" in event:  # every event: an error can come after tokens
                return str(event["error"])
            m.tokens(protocol.event_tokens(event))
        return None


class GrpcInferUser(TritonLLMUser, User):
    """llm_dynamic (default) or llm_static (--triton-model) over unary gRPC infer."""

    model = "llm_dynamic"
    protocol = "grpc-infer"

    def on_start(self):
        self._setup()
        url = self.opts.grpc_url if self.opts is not None and self.opts.grpc_url else default_grpc_url(self.host)
        self.client = grpcclient.InferenceServerClient(url)

    def on_stop(self):
        client, self.client = getattr(self, "client", None), None
        if client is not None:
            _close(client.close)

    @task
    def generate(self):
        spec, m = self._begin()
        error = None
        try:
            result = self.client.infer(self.target, protocol.grpc_inputs(spec, stream=False, batched=True),
                                       outputs=protocol.grpc_outputs(), client_timeout=self.timeout)
            m.tokens(protocol.grpc_result_tokens(result))
        except GreenletExit:
            self._record(m.interrupt())
            raise
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        self._record(m.finish(error))


class HttpInferUser(TritonHttpUser):
    """llm_dynamic (default) or llm_static (--triton-model) over HTTP /infer."""

    model = "llm_dynamic"
    protocol = "http-infer"

    @task
    def generate(self):
        spec, m = self._begin()
        self._post_measured(f"/v2/models/{self.target}/infer", protocol.infer_body(spec), m, self._read_answer)

    @staticmethod
    def _read_answer(resp, m) -> str | None:
        try:
            m.tokens(protocol.infer_output_tokens(resp.json()))
        except ValueError as exc:
            return str(exc)
        return None


class OpenAIStreamUser(TritonLLMUser, HttpUser):
    """Any OpenAI-compatible server at --host over streaming /v1/completions (SSE): the same
    workload, so llama.cpp's llama-server, vLLM or TGI run beside the Triton models."""

    model = "openai"
    protocol = "openai-sse"
    streams = True
    host = "http://127.0.0.1:8080"

    def on_start(self):
        self._setup()
        self.target = self.opts.openai_model if self.opts is not None and self.opts.openai_model else self.model
        self.request_type = f"{self.protocol} {self.target}"

    @task
    def generate(self):
        spec, m = self._begin()
        model = self.opts.openai_model if self.opts is not None else ""
        self._post_measured("/v1/completions", protocol.openai_completion_body(spec, model), m, self._read_events,
                            stream=True)

    @staticmethod
    def _read_events(resp, m) -> str | None:
        usage = None
        for line in resp.iter_lines(chunk_size=None):
            if line.strip() in (b"data: [DONE]", b"data:[DONE]"):
                break
            event = protocol.parse_sse_line(line)
            if event is None:
                continue
            if "error" in event:
                return str(event["error"])
            pieces, completion = protocol.openai_event(event)
            m.tokens(pieces)
            usage = completion if completion is not None else usage
        if usage is not None:  # the server's own count wins over counted pieces (a piece may hold 2 tokens)
            m.sample.output_tokens = usage
        return None


def _close(*steps) -> None:
    """Run every cleanup step even if the user is killed meanwhile (then die afterwards): a gRPC
    channel left open is closed at interpreter exit, where it blocks."""
    killed = None
    for step in steps:
        try:
            step()
        except GreenletExit as exc:
            killed = exc
        except Exception as exc:  # noqa: BLE001  (a broken channel still needs the next step)
            log.debug("cleanup step failed: %s", exc)
    if killed is not None:
        raise killed


def _as_e2e(resp, request_type: str, sample: Sample) -> None:
    """Make the HTTP request's own Locust event the e2e event (end of the body, tokens as length)."""
    resp.request_meta["request_type"] = request_type
    resp.request_meta["response_time"] = (sample.e2e or 0.0) * 1000.0
    resp.request_meta["response_length"] = sample.output_tokens
    if sample.error is None:
        resp.success()
    else:
        resp.failure(sample.error)


def _http_error(resp) -> str:
    if resp.status_code == 0:  # no answer at all (connection refused, timeout): Locust keeps the exception
        return f"{type(resp.error).__name__}: {resp.error}"
    try:
        body = resp.text[:300]
    except Exception:  # noqa: BLE001
        body = "<no body>"
    return f"HTTP {resp.status_code}: {body}"


def default_grpc_url(host: str | None) -> str:
    """host:8001 for the HTTP --host's hostname (Triton's default gRPC port)."""
    hostname = urlsplit(host).hostname if host and "://" in host else (host or "").split(":")[0]
    return f"{hostname or '127.0.0.1'}:8001"
