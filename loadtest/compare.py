"""`tritonllm-compare`: the same workload against llm_inflight, llm_dynamic and llm_static, one
after the other on one server, then a side-by-side report.

    tritonllm-compare                       # bundled SmolLM2: closed loop at 8 users + open-loop sweep, ~8 min
    tritonllm-compare --quick               # only the closed-loop point, ~3 min
    tritonllm-compare --sweep-points 9 --point-time 30                 # a finer, longer sweep
    tritonllm-compare --model tiny --max-requests 24 --run-time 30     # a quick look
    tritonllm-compare --url triton.example:8000 --grpc-url triton.example:8001 \
        --metrics-url http://triton.example:8002/metrics --server never
    tritonllm-compare --openai-url http://127.0.0.1:8080 --openai-name llama.cpp   # + an OpenAI-compatible server

An OpenAI-compatible server (llama.cpp's llama-server, vLLM, TGI) given with --openai-url gets the
same requests over streaming /v1/completions and becomes one more row of the report.

Two kinds of load, each scheme in turn at each load:
- the closed-loop point (--concurrency users, each sending its next request when the last ends),
  which saturates the slots and measures each scheme's throughput;
- an open-loop sweep (--rates): Poisson arrivals at several rates, the same seeded arrival times
  and requests for every scheme at a rate, bounded by count and time per point. `auto` sets the
  rates from the closed-loop point's best req/s (the saturation probe), from 0.1x to 1.6x.

Starts a local Triton (the repository's model_repository/) when none answers at --url, runs
headless Locust in a subprocess per point, scrapes Triton's metrics meanwhile, and writes
everything under --out (default results/<timestamp>/): runs/<scheme>-c<N>/ and
runs/<scheme>-r<rate>/ (Locust CSV + HTML + log, samples.jsonl, metrics.jsonl, run.json),
settings.json, report.md, plots/*.png, summary.json. Exits 1 when the error rate of the
closed-loop point passes --max-error-rate (past saturation the sweep's points may fail requests
by design: bounded queues refuse them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from tritonllm.server.children import die_with_parent, http_status
from tritonllm_loadtest.arrivals import ArrivalSchedule
from tritonllm_loadtest.metrics_scraper import MetricsScraper, wait_until_idle
from tritonllm_loadtest.progress import Progress
from tritonllm_loadtest.report import ReportSettings, build_report
from tritonllm_loadtest.summary import RunInfo, RunSummary, summarize_run_dir
from tritonllm_loadtest.sweep import DRAIN_SLACK, SLO_SLACK, auto_rates, choose_slo, drain_seconds, next_rate, point_requests
from tritonllm_loadtest.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, Workload, load_prompts

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
SCHEMES = {"inflight": "llm_inflight", "dynamic": "llm_dynamic", "static": "llm_static",
           "inflight_shipped": "llm_inflight_shipped"}
# A server this command starts serves llm_inflight at the batchers' cap on concurrent sequences (what
# scheduling alone buys) and llm_inflight_shipped as shipped (admission by KV memory: what paging adds).
SAME_CAP = "llm_inflight"
SHIPPED = "llm_inflight_shipped"
# The open-loop sweep offers inflight_shipped rates from llm_inflight's highest met rate up: below it eight
# sequences at a time kept up, a higher cap has little to add there, and the low rates' long windows
# take most of the sweep's time.
LATE_START = {"inflight_shipped": "inflight"}
CLOSED_SLACK = 3.0  # a batcher needs up to the workload's ideal ratio (~2.4x here) of in-flight's time
IDLE_TIMEOUT_S = 300.0  # the longest a run waits for earlier runs' requests to leave the server
USER_CLASSES = {  # (scheme is streaming, protocol) -> Locust user class
    (True, "grpc"): "GrpcStreamUser", (True, "http"): "SseStreamUser",
    (False, "grpc"): "GrpcInferUser", (False, "http"): "HttpInferUser",
}
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def host_port(url: str, default_port: int) -> tuple[str, int]:
    """('host', port) from 'host:port' or 'http://host:port/...'."""
    parts = urlsplit(url if "://" in url else f"//{url}")
    return parts.hostname or "127.0.0.1", parts.port or default_port


def http_ok(url: str, timeout: float = 2.0) -> bool:
    return http_status(url, timeout) == 200


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tritonllm-compare", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run one workload against in-flight, dynamic and static batching and report side by side.")
    t = p.add_argument_group("target")
    t.add_argument("--url", default="127.0.0.1:8000", help="Triton HTTP address")
    t.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton gRPC address")
    t.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics", help="Triton metrics endpoint")
    t.add_argument("--server", choices=["auto", "never", "always"], default="auto",
                   help="auto: start a local Triton on these ports when none answers; always: start one on free "
                        "ports; never: only use a running one")
    t.add_argument("--model", default="bundled",
                   help="TRITONLLM_MODEL for a server this command starts: bundled (SmolLM2-135M), tiny, a HF "
                        "directory or hub id")
    t.add_argument("--dtype", default="",
                   help="TRITONLLM_DTYPE for a server this command starts: auto, float32, bfloat16 (default: the "
                        "models' config, auto)")
    t.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for a started server")
    t.add_argument("--via", choices=["triton", "openai"], default="triton",
                   help="openai: every scheme through the OpenAI-compatible front (streaming /v1/completions, "
                        "OpenAIStreamUser with model llm_<scheme>) instead of Triton's own protocols")
    t.add_argument("--front-url", default="http://127.0.0.1:9000",
                   help="--via openai: the front to use when it answers there, else one is started on a free "
                        "loopback port against the Triton (and stopped at the end)")
    t.add_argument("--openai-url", default="",
                   help="also run the workload against this OpenAI-compatible server (/v1/completions, streaming)")
    t.add_argument("--openai-name", default="openai", help="its scheme name in the report, e.g. llama.cpp")
    t.add_argument("--openai-model", default="", help="the `model` field its requests carry (default: left out)")
    w = p.add_argument_group("workload")
    w.add_argument("--schemes", default="inflight,dynamic,static,inflight_shipped",
                   help="comma-separated, run in this order; inflight_shipped (llm_inflight as shipped, beside "
                        "llm_inflight at the batchers' cap) only where the server has it: one this command starts")
    w.add_argument("--time-budget", type=float, default=600.0,
                   help="seconds the whole comparison should take: past them a sweep extended past a scheme's "
                        "last met rate stops (after one rate past the sweep's, which runs whatever the time)")
    w.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                   help="grpc: streaming for inflight, infer for the others; http: generate_stream (SSE) / infer")
    w.add_argument("--concurrency", default="8",
                   help="closed-loop users; comma-separated for a concurrency sweep; 'none' for no closed loop")
    w.add_argument("--max-requests", type=int, default=48,
                   help="requests per closed-loop run (the same ones for every scheme)")
    w.add_argument("--run-time", type=float, default=170.0, help="time bound per closed-loop run (s)")
    s = p.add_argument_group("open-loop sweep")
    s.add_argument("--rates", default="auto",
                   help="'auto' (from the closed-loop point's best req/s), 'none', or comma-separated req/s")
    s.add_argument("--quick", action="store_true", help="only the closed-loop point (same as --rates none)")
    s.add_argument("--batch-sizes", default="",
                   help="e.g. 8,16,32,64: the whole comparison at each batch capacity (max_num_seqs of "
                        "llm_inflight = max_batch_size of the batchers), each on a tritonserver this command "
                        "starts, with B users; batch_sizes.md/.png plot tokens/s and capacity against B")
    s.add_argument("--sweep-points", type=int, default=5,
                   help="rates of an auto sweep, from 0.1x to 1.6x saturation on a log scale")
    s.add_argument("--point-time", type=float, default=10.0,
                   help="seconds of arrivals per point (requests = rate x this, at least --point-min-requests)")
    s.add_argument("--point-min-requests", type=int, default=8)
    s.add_argument("--drain-time", type=float, default=15.0,
                   help="seconds a point may run past its last arrival; requests still open then are cut off")
    s.add_argument("--max-users", type=int, default=96,
                   help="open loop: most requests in flight at once (an arrival finding all busy is late)")
    s.add_argument("--slo-normalized", type=float, default=None,
                   help="SLO on mean end-to-end / output tokens (s per token); default: "
                        f"{SLO_SLACK:g}x the worst scheme's at the lowest rate")
    s.add_argument("--slo-e2e-p90", type=float, default=None,
                   help=f"SLO on p90 end-to-end latency (s); default: {SLO_SLACK:g}x the worst scheme's at the lowest rate")
    w.add_argument("--output-tokens", default=DEFAULT_OUTPUT_TOKENS,
                   help="fixed:N | uniform:A:B | exp:MEAN:CAP[:MIN] (forced with max_tokens + ignore_eos)")
    w.add_argument("--prompt-words", default=DEFAULT_PROMPT_WORDS, help="'dataset' or a distribution as above")
    w.add_argument("--prompts-file", default="", help="JSON-lines prompts (default: the shipped set)")
    w.add_argument("--shared-prefix-words", type=int, default=0,
                   help="every prompt starts with the same text of this many words (a shared system prompt: "
                        "what prefix caching serves)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--warmup", type=int, default=8, help="short requests sent to each model before its run (0: none)")
    w.add_argument("--processes", type=int, default=0, help="Locust --processes (distributed on this machine)")
    w.add_argument("--locust-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every locust run (repeatable), e.g. --locust-arg=--loglevel=DEBUG")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="results directory (default results/<timestamp>)")
    o.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between metric scrapes")
    o.add_argument("--max-error-rate", type=float, default=0.01, help="exit 1 above this error rate (0-1)")
    o.add_argument("--quiet", action="store_true", help="no progress lines while a run goes")
    o.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    o.add_argument("--slo-ttft", type=float, default=2.0, help="goodput SLO on TTFT (s)")
    o.add_argument("--slo-tpot", type=float, default=0.5, help="goodput SLO on TPOT (s)")
    o.add_argument("--price-per-hour", type=float, default=None,
                   help="what the machine costs per hour: the report adds cost per million output tokens")
    args = p.parse_args(argv)
    args.schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [s for s in args.schemes if s not in SCHEMES]
    if unknown or not args.schemes:
        p.error(f"unknown scheme(s) {unknown}; choose from {', '.join(SCHEMES)}")
    if args.openai_url:
        if args.openai_name in SCHEMES:
            p.error(f"--openai-name {args.openai_name!r} is one of the Triton schemes; choose another")
        args.openai_url = args.openai_url if "://" in args.openai_url else f"http://{args.openai_url}"
        args.schemes.append(args.openai_name)
    try:
        args.concurrency = ([] if args.concurrency.strip().lower() == "none"
                            else [int(c) for c in args.concurrency.split(",") if c.strip()])
    except ValueError:
        p.error("--concurrency takes comma-separated integers or 'none'")
    if args.concurrency and min(args.concurrency) < 1:
        p.error("--concurrency must be >= 1")
    if args.max_requests < 0 or args.run_time <= 0:
        p.error("--max-requests must be >= 0 and --run-time > 0")
    rates = "none" if args.quick else args.rates.strip().lower()
    if rates in ("auto", "none"):
        args.rates = rates
    else:
        try:
            args.rates = sorted({float(r) for r in rates.split(",") if r.strip()})
        except ValueError:
            p.error("--rates takes 'auto', 'none' or comma-separated req/s")
        if not args.rates or args.rates[0] <= 0:
            p.error("--rates must be > 0")
    if args.rates == "auto" and not args.concurrency:
        p.error("--rates auto sets the rates from the closed-loop point: give --concurrency, or the rates")
    if args.rates == "none" and not args.concurrency:
        p.error("nothing to run: --concurrency none and --rates none")
    if args.sweep_points < 1 or args.point_time <= 0 or args.drain_time <= 0 or args.point_min_requests < 1:
        p.error("--sweep-points, --point-time, --drain-time and --point-min-requests must be > 0")
    if args.max_users < 1:
        p.error("--max-users must be >= 1")
    try:
        args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    except ValueError:
        p.error("--batch-sizes takes comma-separated integers")
    if args.batch_sizes and (args.batch_sizes[0] < 1 or args.openai_url or args.via == "openai"):
        p.error("--batch-sizes takes capacities >= 1, for the Triton schemes (not with --openai-url or --via openai)")
    return args


class Target:
    """The Triton the runs go to: a running one, or one this command starts (and stops)."""

    def __init__(self, args: argparse.Namespace, out: Path):
        self.args, self.out = args, out
        self.server = None
        host, port = host_port(args.url, 8000)
        self.http = f"{host}:{port}"
        ghost, gport = host_port(args.grpc_url, 8001)
        self.grpc = f"{ghost}:{gport}"
        self.metrics = args.metrics_url if "://" in args.metrics_url else f"http://{args.metrics_url}"
        self.note = ""
        self.front = None  # the OpenAI front this command started (--via openai)
        self.front_url = args.front_url.rstrip("/") if "://" in args.front_url else f"http://{args.front_url}"

    @property
    def base(self) -> str:
        return f"http://{self.http}"

    def ready(self) -> bool:
        return http_ok(f"{self.base}/v2/health/ready")

    def cpu_seconds(self) -> float | None:
        """CPU time of the server's processes so far (and of the front it started), when this command started
        the server."""
        if self.server is None:
            return None
        front = 0.0
        if self.front is not None and self.front.process is not None:
            from tritonllm.server.tritonserver import process_cpu_seconds
            front = process_cpu_seconds(self.front.process.pid)
        return self.server.cpu_seconds() + front

    def start_front(self) -> None:
        """--via openai: the front at --front-url if it answers, else one started here against this Triton."""
        if http_ok(f"{self.front_url}/health/ready"):
            self.note += f" Every scheme went through the OpenAI front already running at {self.front_url}."
            log(f"using the OpenAI front at {self.front_url}")
            return
        from tritonllm.server.openai_front import OpenAIFront
        from tritonllm.server.tritonserver import find_free_ports

        (port,) = find_free_ports(1)
        models = [SCHEMES[s] for s in self.args.schemes if s in SCHEMES]  # a Triton may serve only these
        self.front = OpenAIFront(self.grpc, port=port, models=models, log_file=self.out / "openai.log",
                                 tokenizer=self.args.model if self.server is not None else None)
        log(f"starting the OpenAI front on 127.0.0.1:{port} (log {self.front.log_file}) ...")
        self.front.start()
        self.front_url = self.front.root
        self.note += f" Every scheme went through the OpenAI front (tritonllm-openai) this command started at {self.front_url}."

    def __enter__(self) -> "Target":
        args = self.args
        if args.server != "always" and self.ready():
            self.note = f"Used the Triton already running at {self.base} (its model is whatever it was started with)."
            log(self.note)
            return self
        if args.server == "never":
            raise SystemExit(f"error: no Triton answers at {self.base}/v2/health/ready (--server never)")
        from tritonllm.server.tritonserver import TritonServer, find_free_ports  # only when starting one

        if args.server == "always":
            http, grpc, metrics = find_free_ports(3)
            host = "127.0.0.1"
        else:
            host, http = host_port(args.url, 8000)
            _, grpc = host_port(args.grpc_url, 8001)
            _, metrics = host_port(self.metrics, 8002)
            if host not in LOOPBACK:
                raise SystemExit(f"error: no Triton answers at {self.base}; this command only starts one on "
                                 "loopback (start it there, or use --server always)")
            host = "127.0.0.1"
        log_file = self.out / "tritonserver.log"
        self.server = TritonServer(comparison_repository(self.out / "repository", args.schemes), http_port=http, grpc_port=grpc, metrics_port=metrics, host=host,
                                   log_file=log_file, env={"TRITONLLM_MODEL": args.model,
                                                           **({"TRITONLLM_DTYPE": args.dtype} if args.dtype else {})},
                                   ready_timeout=args.ready_timeout)
        log(f"starting tritonserver (model {args.model!r}, log {log_file}) ...")
        self.server.start()
        self.http, self.grpc, self.metrics = self.server.http_url, self.server.grpc_url, self.server.metrics_url
        self.note = (f"Started tritonserver for this comparison with TRITONLLM_MODEL={args.model} "
                     f"(ready in {self.server.ready_seconds:.0f} s).")
        log(f"tritonserver ready in {self.server.ready_seconds:.0f} s: HTTP {self.http}, gRPC {self.grpc}")
        return self

    def __exit__(self, *exc) -> None:
        if self.front is not None:
            log("stopping the OpenAI front")
            self.front.stop(timeout=30)
        if self.server is not None:
            log("stopping tritonserver")
            self.server.stop()


def comparison_repository(dest: Path, schemes: list[str]) -> Path:
    """The shipped models, llm_inflight capped at the batchers' max_batch_size on concurrent sequences,
    and (for inflight_shipped) llm_inflight as shipped under the name llm_inflight_shipped."""
    from tritonllm.server.repository import configured_repository

    if dest.exists():
        shutil.rmtree(dest)
    models = {m: {} for s, m in SCHEMES.items() if s in schemes}
    if SAME_CAP in models:
        models[SAME_CAP] = {"max_num_seqs": str(batch_cap())}
    return configured_repository(dest, models, {SHIPPED: SAME_CAP})


def batch_cap() -> int:
    """The batchers' max_batch_size as shipped: the cap llm_inflight gets in a server this command starts."""
    from tritonllm.server.repository import read_config

    return int(re.search(r"(?m)^max_batch_size: (\d+)", read_config("llm_dynamic")[0]).group(1))


def served_models(target: Target) -> dict[str, dict]:
    """What each model of the server runs: dtype, device, quantization (tritonllm_model_info), its cap on
    concurrent sequences and KV blocks (its config, from Triton)."""
    from tritonllm.server.tritonserver import model_info

    info = model_info(target.metrics)
    out = {}
    for model, labels in info.items():
        try:
            with urllib.request.urlopen(f"{target.base}/v2/models/{model}/config", timeout=10) as resp:
                config = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            config = {}
        params = {k: v.get("string_value") for k, v in config.get("parameters", {}).items()}
        cap = config.get("max_batch_size") or params.get("max_num_seqs")
        out[model] = {**labels, "max_concurrent_sequences": int(cap) if cap else None,
                      "kv_blocks": int(params["num_kv_blocks"]) if params.get("num_kv_blocks", "").isdigit() else None}
    return out


def machine() -> dict:
    """The load generator's machine (the server's too when this command started it); the load test's
    image has no torch, so its version is read from the installed package's metadata, if any."""
    import importlib.metadata

    from tritonllm.kernels import cpu_isa

    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    return {**cpu_isa.describe(), "torch": torch_version}


def check_models(target: Target, models: list[str]) -> None:
    missing = [m for m in models if not http_ok(f"{target.base}/v2/models/{m}/ready")]
    if missing:
        raise SystemExit(f"error: model(s) not ready at {target.base}: {', '.join(missing)}")


def warm_up(url: str, body: dict, n: int) -> str | None:
    """n concurrent short requests (a static batch needs a full batch to start): None or an error."""
    if n <= 0:
        return None
    data = json.dumps(body).encode()

    def one(_):
        req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()

    try:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n)))
    except (urllib.error.URLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def warm_up_scheme(args, target: Target, scheme: str) -> str | None:
    if scheme in SCHEMES and args.via == "openai":
        body = {"model": SCHEMES[scheme], "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
        return warm_up(f"{target.front_url}/v1/completions", body, args.warmup)
    if scheme in SCHEMES:
        body = {"text_input": "Hello", "max_tokens": 4, "ignore_eos": True, "exclude_input_in_output": True}
        return warm_up(f"{target.base}/v2/models/{SCHEMES[scheme]}/generate", body, args.warmup)
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **({"model": args.openai_model} if args.openai_model else {})}
    return warm_up(f"{args.openai_url}/v1/completions", body, args.warmup)


def scheme_model(args, scheme: str) -> str:
    return SCHEMES.get(scheme) or args.openai_model or args.openai_name


@dataclass(frozen=True)
class Point:
    """One load for every scheme: closed loop (`users` busy users) or open loop (Poisson `rate`)."""

    users: int
    requests: int
    run_time: float
    rate: float = 0.0

    def name(self, scheme: str) -> str:
        return f"{scheme}-r{self.rate:g}" if self.rate else f"{scheme}-c{self.users}"


def closed_loop_points(args) -> list[Point]:
    return [Point(users, args.max_requests, args.run_time) for users in args.concurrency]


def open_loop_points(args, rates: list[float], workload: Workload, step_s: float | None = None) -> list[Point]:
    """Each rate's first n seeded arrivals, n = rate x --point-time (at least --point-min-requests); the
    point may run past its last arrival --drain-time, or longer where its longest request needs it at
    `step_s` (the slowest scheme's measured seconds per step; sweep.drain_seconds)."""
    points = []
    for rate in rates:
        n = point_requests(rate, args.point_time, args.point_min_requests)
        last_arrival = ArrivalSchedule(rate, args.seed).at(n - 1)
        longest = max(workload.request(i).max_tokens for i in range(n))
        drain = drain_seconds(longest, step_s, args.drain_time)
        points.append(Point(args.max_users, n, math.ceil(last_arrival + drain), rate))
    return points


def step_seconds(closed: list[RunSummary]) -> float | None:
    """The slowest Triton scheme's seconds per engine step in the closed-loop runs (None: not measured)."""
    return max((s.ms_per_step / 1000 for s in closed if s.scheme in SCHEMES and s.ms_per_step), default=None)


def locust_command(args, target: Target, scheme: str, point: Point, run_dir: Path) -> tuple[list[str], str]:
    if scheme in SCHEMES and args.via == "openai":  # the same model, through the OpenAI front
        user_class = "OpenAIStreamUser"
        where = ["--host", target.front_url, "--openai-model", SCHEMES[scheme]]
    elif scheme in SCHEMES:
        user_class = USER_CLASSES[(scheme.startswith("inflight"), args.protocol)]
        where = ["--host", target.base, "--grpc-url", target.grpc, "--triton-model", SCHEMES[scheme]]
    else:  # the OpenAI-compatible server
        user_class = "OpenAIStreamUser"
        where = ["--host", args.openai_url] + (["--openai-model", args.openai_model] if args.openai_model else [])
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
           "-u", str(point.users), "-r", str(point.users), "-t", f"{int(round(point.run_time))}s", *where,
           "--csv", str(run_dir / "locust"), "--html", str(run_dir / "locust.html"),
           "--logfile", str(run_dir / "locust.log"), "--only-summary",
           "--samples-file", str(run_dir / "samples.jsonl"), "--max-requests", str(point.requests),
           "--output-tokens", args.output_tokens, "--prompt-words", args.prompt_words,
           "--shared-prefix-words", str(args.shared_prefix_words), "--workload-seed", str(args.seed), "--temperature", str(args.temperature),
           "--arrival-rate", str(point.rate)]
    if args.prompts_file:
        cmd += ["--prompts-file", str(Path(args.prompts_file).resolve())]
    if args.processes:
        cmd += ["--processes", str(args.processes)]
    return cmd + list(args.locust_arg) + [user_class], user_class


def run_locust(cmd: list[str], run_dir: Path, time_limit: float) -> int:
    """Run locust; past time_limit (its own -t plus slack) it gets SIGTERM, then SIGKILL."""
    with open(run_dir / "locust.out", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=run_dir, start_new_session=True, preexec_fn=die_with_parent)
        try:
            return proc.wait(timeout=time_limit)
        except subprocess.TimeoutExpired:
            log(f"locust did not finish in {time_limit:.0f} s: stopping it")
            _signal_group(proc, signal.SIGTERM)  # locust writes its reports on SIGTERM
            try:
                return proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                return proc.wait()
        except BaseException:  # Ctrl-C: locust runs in its own session and did not get it
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            raise


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal locust and its --processes workers (its own process group)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


class Comparison:
    """Runs points against the schemes and keeps their summaries."""

    def __init__(self, args, target: Target, workload: Workload, out: Path,
                 before_scheme: Callable[[str], None] | None = None):
        self.args, self.target, self.workload, self.out = args, target, workload, out
        self.before_scheme = before_scheme
        self.summaries: list[RunSummary] = []
        self.warm: set[str] = set()

    def run(self, point: Point, schemes: list[str] | None = None) -> list[RunSummary]:
        return [self.run_one(scheme, point) for scheme in schemes or self.args.schemes]

    def run_one(self, scheme: str, point: Point) -> RunSummary:
        args, target = self.args, self.target
        name = point.name(scheme)
        run_dir = self.out / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.before_scheme is not None:
            self.before_scheme(scheme)
        if scheme not in self.warm:  # once per scheme: later points find the model warm
            problem = warm_up_scheme(args, target, scheme)
            if problem:
                log(f"{name}: warm-up failed ({problem}); running anyway")
            self.warm.add(scheme)
        cmd, user_class = locust_command(args, target, scheme, point, run_dir)
        info = RunInfo(name=name, scheme=scheme, model=scheme_model(args, scheme), user_class=user_class,
                       protocol=user_class_protocol(user_class), concurrency=point.users, arrival_rate=point.rate,
                       max_requests=point.requests, run_time_s=point.run_time, workload=self.workload.describe(),
                       command=cmd)
        load = f"Poisson {point.rate:g} req/s, ≤{point.users} in flight" if point.rate else f"{point.users} users"
        log(f"{name}: {load}, {user_class} -> {info.model} (≤{point.requests or '∞'} requests, "
            f"≤{point.run_time:g} s)")
        scrape = scheme in SCHEMES  # Triton's metrics say nothing about another server
        if scrape:
            waited, busy = wait_until_idle(target.metrics, IDLE_TIMEOUT_S)
            if busy:
                log(f"{name}: the server still had requests in hand after {waited:.0f} s ({', '.join(busy)}); running anyway")
            elif waited >= 1:
                log(f"{name}: waited {waited:.0f} s for the server to finish earlier runs' requests")
        cpu_before = target.cpu_seconds() if scrape else None
        info.started = time.time()
        with (MetricsScraper(target.metrics, run_dir / "metrics.jsonl", args.scrape_interval) if scrape
              else contextlib.nullcontext()), \
                (Progress(run_dir / "samples.jsonl", name, point.requests, args.progress_interval, log)
                 if not args.quiet else contextlib.nullcontext()):
            info.locust_rc = run_locust(cmd, run_dir, point.run_time + 90)
        info.ended = time.time()
        if cpu_before is not None:
            info.server_cpu_s = target.cpu_seconds() - cpu_before
        info.save(run_dir)
        _, _, _, s = summarize_run_dir(run_dir, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
        log(f"{name}: {s.finished} finished, {s.errors} errors, {s.interrupted} cut off, "
            f"{_num(s.tokens_per_s)} output tok/s, TTFT p50 {_num(s.ttft_p50)} s, "
            f"e2e p90 {_num(s.e2e_p90)} s in {info.ended - info.started:.0f} s (locust rc {info.locust_rc})")
        self.summaries.append(s)
        return s


def run_closed_loop(args, comparison: Comparison) -> list[RunSummary]:
    """Each closed-loop point, each scheme in turn. A point's time bound grows to CLOSED_SLACK x a scheme's
    run that answered every request, where that is longer, so that on a slow CPU the batchers answer
    the same requests as in-flight batching. `inflight_shipped` would run what `inflight` runs wherever
    the users are no more than the batchers' cap (8 by default): it runs where more users ask for it."""
    summaries = []
    for point in closed_loop_points(args):
        for scheme in [x for x in args.schemes if x != "inflight_shipped" or point.users > batch_cap()]:
            s = comparison.run_one(scheme, point)
            summaries.append(s)
            if s.duration_s and s.ok == point.requests and CLOSED_SLACK * s.duration_s > point.run_time:
                point = replace(point, run_time=math.ceil(CLOSED_SLACK * s.duration_s))
                log(f"{scheme} took {s.duration_s:.0f} s at {point.users} users: the next schemes may take "
                    f"{point.run_time:g} s")
    return summaries


def sweep_rates(args, closed: list[RunSummary]) -> list[float]:
    if args.rates != "auto":
        return args.rates
    top = max(args.concurrency)
    best = max((s.requests_per_s or 0.0 for s in closed if s.concurrency == top), default=0.0)
    if best <= 0:
        log("the closed-loop point answered no request: no saturation throughput to set the sweep's rates from; "
            "no sweep (give --rates to run one anyway)")
        return []
    rates = auto_rates(best, args.sweep_points)
    log(f"saturation probe: best closed-loop throughput {best:.3g} req/s at {top} users -> rates "
        f"{', '.join(f'{r:g}' for r in rates)} req/s")
    return rates


def run_sweep(args, comparison: Comparison, rates: list[float], t_start: float, step_s: float | None = None) -> None:
    """The open-loop points, each scheme in turn. With --rates auto, a scheme that missed the SLO at a
    rate is not offered higher ones (its capacity is bracketed), and one that met every rate is offered
    EXTEND x its highest until it misses (the first such rate whatever the time, the next ones within
    --time-budget), so that every capacity lies between a met and a missed rate. `inflight_shipped` starts at llm_inflight's highest met rate (LATE_START).
    Rates given by the user all run, as given."""
    points = open_loop_points(args, rates, comparison.workload, step_s)
    if args.rates != "auto":
        for point in points:
            comparison.run(point)
        return
    late = [s for s in args.schemes if s in LATE_START and LATE_START[s] in args.schemes]
    slo, done = None, set()  # done: missed once, or out of time
    for point in points:
        for scheme in args.schemes:
            if scheme in done:
                log(f"{point.name(scheme)}: not run ({scheme} missed the SLO at a lower rate)")
            elif scheme not in late:
                comparison.run_one(scheme, point)
        if slo is None:
            try:
                slo = choose_slo([s for s in comparison.summaries if s.arrival_rate == point.rate],
                                 args.slo_normalized, args.slo_e2e_p90)
            except ValueError as exc:
                log(f"no SLO from the lowest rate ({exc}): every rate runs for every scheme")
                late = []
                continue
        done |= {s.scheme for s in comparison.summaries if s.arrival_rate == point.rate and not slo.met(s)}
    if slo is None:
        return
    for scheme in late:  # from its reference's highest met rate (the lowest rate if it met none) up
        reference = [s.arrival_rate for s in comparison.summaries if s.scheme == LATE_START[scheme]
                     and s.arrival_rate and slo.met(s)]
        first = max(reference, default=rates[0])
        log(f"{scheme}: starting at {first:g} req/s, {LATE_START[scheme]}'s highest met rate")
        for point in points:
            if point.rate >= first and scheme not in done and not slo.met(comparison.run_one(scheme, point)):
                done.add(scheme)
    extended = set()  # offered one rate past the sweep's: that one runs whatever the time budget
    while True:
        pending = {}
        for scheme in args.schemes:
            rate = None if scheme in done else next_rate(
                [s for s in comparison.summaries if s.scheme == scheme and s.arrival_rate], slo)
            if rate is not None:
                pending[scheme] = rate
        if not pending:
            return
        for scheme, rate in pending.items():
            (point,) = open_loop_points(args, [rate], comparison.workload, step_s)
            if scheme in extended and time.monotonic() - t_start + point.run_time + 60 > args.time_budget:
                log(f"{point.name(scheme)}: not run (past --time-budget {args.time_budget:g} s): {scheme}'s capacity "
                    "stays a lower bound")
                done.add(scheme)
                continue
            log(f"{scheme} met the SLO at every rate so far: offering {rate:g} req/s")
            extended.add(scheme)
            if not slo.met(comparison.run_one(scheme, point)):
                done.add(scheme)


def main(argv: list[str] | None = None, before_scheme: Callable[[str], None] | None = None) -> int:
    """`before_scheme(scheme)` (for programs that call this) runs before each scheme's run: e.g. to pause a
    peer server whose idle threads would take CPU from the others' rows."""
    args = parse_args(argv)
    workload = Workload(load_prompts(args.prompts_file or None), args.output_tokens, args.prompt_words,
                        args.seed, args.temperature, shared_prefix_words=args.shared_prefix_words)  # validates the flags
    # Absolute: each locust runs with its run directory as working directory.
    out = (args.out or Path("results") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.batch_sizes:
        from tritonllm_loadtest import batch_sizes

        code = batch_sizes.run(args, list(sys.argv[1:] if argv is None else argv), out)
        log(f"batch-size view: {out / 'batch_sizes.md'}")
        return code
    t_start = time.monotonic()
    log(f"results -> {out}")
    earlier = out / "runs"
    if earlier.is_dir() and any(earlier.iterdir()):  # its samples would be counted (appended) in this report
        log(f"{earlier} holds the runs of an earlier comparison: replacing them (a report covers one comparison)")
        shutil.rmtree(earlier)
    log(f"workload: {workload.describe()}")
    with Target(args, out) as target:
        if target.server is None and "inflight_shipped" in args.schemes and not http_ok(
                f"{target.base}/v2/models/{SHIPPED}/ready"):
            args.schemes.remove("inflight_shipped")  # a server of the user's: its llm_inflight as it runs it
        check_models(target, [SCHEMES[s] for s in args.schemes if s in SCHEMES])
        if args.via == "openai":
            target.start_front()
        models = served_models(target)
        target.note += " Models run: " + (", ".join(f"{m}: {describe_model(i)}" for m, i in sorted(models.items()))
                                          or "unknown (no tritonllm_model_info on the metrics page)") + "."
        log(target.note)
        comparison = Comparison(args, target, workload, out, before_scheme)
        closed = run_closed_loop(args, comparison)
        rates = [] if args.rates == "none" else sweep_rates(args, closed)
        step_s = step_seconds(closed)
        if rates and step_s:
            log(f"open-loop points may drain up to {drain_seconds(workload.output_tokens.cap, step_s, args.drain_time):.0f} s "
                f"(the slowest scheme's {1000 * step_s:.0f} ms a step)")
        run_sweep(args, comparison, rates, t_start, step_s)
    command = "tritonllm-compare " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    settings = ReportSettings(slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot,
                              slo_normalized_s=args.slo_normalized, slo_e2e_p90_s=args.slo_e2e_p90,
                              price_per_hour=args.price_per_hour,
                              ideal_ratio={users: workload.ideal_inflight_ratio(args.max_requests, users)
                                           for users in args.concurrency} if args.max_requests else {})
    drain = (f"at most {args.drain_time:g} s more to drain" if not step_s else
             f"time to drain: at least {args.drain_time:g} s, {DRAIN_SLACK:g} x the point's longest request's tokens x "
             f"{1000 * step_s:.0f} ms (the slowest scheme's time per step in the closed loop) where longer")
    late = [f"{s} ran from {LATE_START[s]}'s highest met rate up" for s in args.schemes
            if s in LATE_START and LATE_START[s] in args.schemes and args.rates == "auto"]
    sweep = (f" Open-loop points: {args.point_time:g} s of arrivals (at least {args.point_min_requests} requests), "
             f"{drain}, ≤{args.max_users} requests in flight." + (f" {'; '.join(late)}." if late else "") if rates else "")
    notes = [f"Command: `{command}`", "", target.note, "",
             f"Each scheme ran with the same requests (seed {args.seed}) over "
             f"{'the OpenAI front (streaming /v1/completions)' if args.via == 'openai' else args.protocol}; closed-loop runs: at "
             f"most {args.max_requests or 'unbounded'} requests and {args.run_time:g} s (or {CLOSED_SLACK:g}x an earlier "
             f"scheme's run that answered them all, where longer).{sweep} Total wall time "
             f"{time.monotonic() - t_start:.0f} s."]
    settings.notes = notes
    settings.models, settings.machine = models, machine()
    settings.save(out)
    report = build_report(out, settings=settings)
    _print_summary(out)
    log(f"report: {report.resolve()}")
    # The verdict: the closed-loop point (or, without one, every point) must answer; past saturation the
    # sweep may see refusals by design.
    judged = closed or comparison.summaries
    total_errors = sum(s.errors for s in judged)
    total_finished = sum(s.finished for s in judged)
    empty_runs = [s.name for s in judged if s.finished == 0]
    rate = total_errors / total_finished if total_finished else 1.0
    log(f"done in {time.monotonic() - t_start:.0f} s; error rate {rate:.2%} (threshold {args.max_error_rate:.2%})")
    if empty_runs:
        log(f"FAIL: no finished request in {', '.join(empty_runs)}")
        return 1
    if rate > args.max_error_rate:
        log("FAIL: error rate above --max-error-rate")
        return 1
    return 0


def describe_model(info: dict) -> str:
    quantized = f", {info['quantization']} weights" if info.get("quantization", "none") != "none" else ""
    cap = info.get("max_concurrent_sequences")
    kv = f", {info['kv_blocks']} KV blocks" if info.get("kv_blocks") else ""
    return f"{info.get('dtype', '?')}{quantized} on {info.get('device', '?')}, ≤{cap or '?'} sequences at once{kv}"


def user_class_protocol(user_class: str) -> str:
    return {"GrpcStreamUser": "grpc-stream", "SseStreamUser": "http-sse", "GrpcInferUser": "grpc-infer",
            "HttpInferUser": "http-infer", "OpenAIStreamUser": "openai-sse"}[user_class]


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _print_summary(out: Path) -> None:
    summary = json.loads((out / "summary.json").read_text())
    for r in summary["ratios"]:
        load = f"{r['arrival_rate']:g} req/s" if r["arrival_rate"] else f"c={r['concurrency']}"
        log(f"in-flight vs {r['baseline']} ({load}): output tok/s x{_num(r['tokens_per_s'])}, "
            f"median TTFT x{_num(r['ttft_p50'])}, p90 e2e x{_num(r['e2e_p90'])}, req/s x{_num(r['requests_per_s'])}")
    for scheme, cap in summary["capacity"].items():
        bound = {"=": "", ">=": "≥ ", "<": "< "}[cap["bound"]]
        rate = cap["rate"] if cap["rate"] is not None else cap["lowest_rate"]
        log(f"{scheme}: capacity under the SLO {bound}{rate:.3g} req/s")


if __name__ == "__main__":
    sys.exit(main())
