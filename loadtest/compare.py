"""`tritonllm-compare`: the same workload against llm_inflight, llm_dynamic and llm_static, one
after the other on one server, then a side-by-side report.

    tritonllm-compare                       # bundled SmolLM2, concurrency 8, ~4-9 min on 2 CPU cores
    tritonllm-compare --model tiny --max-requests 24 --run-time 30     # a quick look
    tritonllm-compare --url triton.example:8000 --grpc-url triton.example:8001 \
        --metrics-url http://triton.example:8002/metrics --server never
    tritonllm-compare --openai-url http://127.0.0.1:8080 --openai-name llama.cpp   # + an OpenAI-compatible server

An OpenAI-compatible server (llama.cpp's llama-server, vLLM, TGI) given with --openai-url gets the
same requests over streaming /v1/completions and becomes one more row of the report.

Starts a local Triton (the repository's model_repository/) when none answers at --url, runs
headless Locust in a subprocess per scheme (bounded by --run-time and --max-requests), scrapes
Triton's metrics meanwhile, and writes everything under --out (default results/<timestamp>/):
runs/<scheme>-c<N>/ (Locust CSV + HTML + log, samples.jsonl, metrics.jsonl, run.json),
report.md, plots/*.png, summary.json. Exits 1 when the error rate passes --max-error-rate.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from tritonllm_loadtest.metrics_scraper import MetricsScraper
from tritonllm_loadtest.progress import Progress
from tritonllm_loadtest.report import build_report
from tritonllm_loadtest.summary import RunInfo, summarize_run_dir
from tritonllm_loadtest.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, Workload, load_prompts

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
SCHEMES = {"inflight": "llm_inflight", "dynamic": "llm_dynamic", "static": "llm_static"}
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
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


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
    t.add_argument("--openai-url", default="",
                   help="also run the workload against this OpenAI-compatible server (/v1/completions, streaming)")
    t.add_argument("--openai-name", default="openai", help="its scheme name in the report, e.g. llama.cpp")
    t.add_argument("--openai-model", default="", help="the `model` field its requests carry (default: left out)")
    w = p.add_argument_group("workload")
    w.add_argument("--schemes", default="inflight,dynamic,static", help="comma-separated, run in this order")
    w.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                   help="grpc: streaming for inflight, infer for the others; http: generate_stream (SSE) / infer")
    w.add_argument("--concurrency", default="8", help="closed-loop users; comma-separated for a sweep")
    w.add_argument("--arrival-rate", type=float, default=0.0,
                   help="Poisson arrivals (req/s) instead of a closed loop; --concurrency is then the user cap")
    w.add_argument("--max-requests", type=int, default=48, help="requests per run (the same ones for every scheme)")
    w.add_argument("--run-time", type=float, default=170.0, help="time bound per run (s); cuts the run short")
    w.add_argument("--output-tokens", default=DEFAULT_OUTPUT_TOKENS,
                   help="fixed:N | uniform:A:B | exp:MEAN:CAP[:MIN] (forced with max_tokens + ignore_eos)")
    w.add_argument("--prompt-words", default=DEFAULT_PROMPT_WORDS, help="'dataset' or a distribution as above")
    w.add_argument("--prompts-file", default="", help="JSON-lines prompts (default: the shipped set)")
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
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error("--concurrency takes comma-separated integers")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency must be >= 1")
    if args.max_requests < 0 or args.run_time <= 0:
        p.error("--max-requests must be >= 0 and --run-time > 0")
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

    @property
    def base(self) -> str:
        return f"http://{self.http}"

    def ready(self) -> bool:
        return http_ok(f"{self.base}/v2/health/ready")

    def __enter__(self) -> "Target":
        args = self.args
        if args.server != "always" and self.ready():
            self.note = f"Used the Triton already running at {self.base} (its model is whatever it was started with)."
            log(self.note)
            return self
        if args.server == "never":
            raise SystemExit(f"error: no Triton answers at {self.base}/v2/health/ready (--server never)")
        from tritonllm.server.launcher import TritonServer, find_free_ports  # only when starting one

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
        self.server = TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, host=host,
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
        if self.server is not None:
            log("stopping tritonserver")
            self.server.stop()


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
    if scheme in SCHEMES:
        body = {"text_input": "Hello", "max_tokens": 4, "ignore_eos": True, "exclude_input_in_output": True}
        return warm_up(f"{target.base}/v2/models/{SCHEMES[scheme]}/generate", body, args.warmup)
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, **({"model": args.openai_model} if args.openai_model else {})}
    return warm_up(f"{args.openai_url}/v1/completions", body, args.warmup)


def scheme_model(args, scheme: str) -> str:
    return SCHEMES.get(scheme) or args.openai_model or args.openai_name


def locust_command(args, target: Target, scheme: str, users: int, run_dir: Path) -> tuple[list[str], str]:
    if scheme in SCHEMES:
        user_class = USER_CLASSES[(scheme == "inflight", args.protocol)]
        where = ["--host", target.base, "--grpc-url", target.grpc, "--triton-model", SCHEMES[scheme]]
    else:  # the OpenAI-compatible server
        user_class = "OpenAIStreamUser"
        where = ["--host", args.openai_url] + (["--openai-model", args.openai_model] if args.openai_model else [])
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
           "-u", str(users), "-r", str(users), "-t", f"{int(round(args.run_time))}s", *where,
           "--csv", str(run_dir / "locust"), "--html", str(run_dir / "locust.html"),
           "--logfile", str(run_dir / "locust.log"), "--only-summary",
           "--samples-file", str(run_dir / "samples.jsonl"), "--max-requests", str(args.max_requests),
           "--output-tokens", args.output_tokens, "--prompt-words", args.prompt_words,
           "--workload-seed", str(args.seed), "--temperature", str(args.temperature),
           "--arrival-rate", str(args.arrival_rate)]
    if args.prompts_file:
        cmd += ["--prompts-file", str(Path(args.prompts_file).resolve())]
    if args.processes:
        cmd += ["--processes", str(args.processes)]
    return cmd + list(args.locust_arg) + [user_class], user_class


def run_locust(cmd: list[str], run_dir: Path, time_limit: float) -> int:
    """Run locust; past time_limit (its own -t plus slack) it gets SIGTERM, then SIGKILL."""
    with open(run_dir / "locust.out", "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=run_dir, start_new_session=True)
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(load_prompts(args.prompts_file or None), args.output_tokens, args.prompt_words,
                        args.seed, args.temperature)  # validates the flags before anything starts
    # Absolute: each locust runs with its run directory as working directory.
    out = (args.out or Path("results") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    log(f"results -> {out}")
    log(f"workload: {workload.describe()}")
    total_errors = total_finished = 0
    empty_runs = []
    with Target(args, out) as target:
        check_models(target, [SCHEMES[s] for s in args.schemes if s in SCHEMES])
        from tritonllm.server.launcher import model_runs

        runs = model_runs(target.metrics)
        target.note += " Models run: " + (", ".join(f"{m} in {r}" for m, r in sorted(runs.items())) or "unknown") + "."
        log(target.note)
        for users in args.concurrency:
            for scheme in args.schemes:
                model = scheme_model(args, scheme)
                name = f"{scheme}-c{users}" if not args.arrival_rate else f"{scheme}-r{args.arrival_rate:g}-c{users}"
                run_dir = out / "runs" / name
                run_dir.mkdir(parents=True, exist_ok=True)
                problem = warm_up_scheme(args, target, scheme)
                if problem:
                    log(f"{name}: warm-up failed ({problem}); running anyway")
                cmd, user_class = locust_command(args, target, scheme, users, run_dir)
                info = RunInfo(name=name, scheme=scheme, model=model, user_class=user_class,
                               protocol=user_class_protocol(user_class), concurrency=users,
                               arrival_rate=args.arrival_rate, max_requests=args.max_requests,
                               run_time_s=args.run_time, workload=workload.describe(), command=cmd)
                log(f"{name}: {users} users, {user_class} -> {model} (≤{args.max_requests or '∞'} requests, "
                    f"≤{args.run_time:g} s)")
                info.started = time.time()
                scrape = scheme in SCHEMES  # Triton's metrics say nothing about another server
                with (MetricsScraper(target.metrics, run_dir / "metrics.jsonl", args.scrape_interval) if scrape
                      else contextlib.nullcontext()), \
                        (Progress(run_dir / "samples.jsonl", name, args.max_requests, args.progress_interval, log)
                         if not args.quiet else contextlib.nullcontext()):
                    info.locust_rc = run_locust(cmd, run_dir, args.run_time + 90)
                info.ended = time.time()
                info.save(run_dir)
                _, _, _, s = summarize_run_dir(run_dir, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
                total_errors += s.errors
                total_finished += s.finished
                if s.finished == 0:
                    empty_runs.append(name)
                log(f"{name}: {s.finished} finished, {s.errors} errors, {s.interrupted} cut off, "
                    f"{_num(s.tokens_per_s)} output tok/s, TTFT p50 {_num(s.ttft_p50)} s, "
                    f"e2e p90 {_num(s.e2e_p90)} s in {info.ended - info.started:.0f} s (locust rc {info.locust_rc})")
    command = "tritonllm-compare " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    notes = [f"Command: `{command}`", "", target.note, "",
             f"Each scheme ran with the same requests (seed {args.seed}), at most {args.max_requests or 'unbounded'} "
             f"requests and {args.run_time:g} s per run, over {args.protocol}; total wall time "
             f"{time.monotonic() - t_start:.0f} s."]
    report = build_report(out, notes=notes, slo_ttft_s=args.slo_ttft, slo_tpot_s=args.slo_tpot)
    _print_summary(out)
    rate = total_errors / total_finished if total_finished else 1.0
    log(f"report: {report.resolve()}")
    log(f"done in {time.monotonic() - t_start:.0f} s; error rate {rate:.2%} (threshold {args.max_error_rate:.2%})")
    if empty_runs:
        log(f"FAIL: no finished request in {', '.join(empty_runs)}")
        return 1
    if rate > args.max_error_rate:
        log("FAIL: error rate above --max-error-rate")
        return 1
    return 0


def user_class_protocol(user_class: str) -> str:
    return {"GrpcStreamUser": "grpc-stream", "SseStreamUser": "http-sse", "GrpcInferUser": "grpc-infer",
            "HttpInferUser": "http-infer", "OpenAIStreamUser": "openai-sse"}[user_class]


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _print_summary(out: Path) -> None:
    summary = json.loads((out / "summary.json").read_text())
    for r in summary["ratios"]:
        log(f"in-flight vs {r['baseline']} (c={r['concurrency']}): output tok/s x{_num(r['tokens_per_s'])}, "
            f"median TTFT x{_num(r['ttft_p50'])}, p90 e2e x{_num(r['e2e_p90'])}, req/s x{_num(r['requests_per_s'])}")


if __name__ == "__main__":
    sys.exit(main())
