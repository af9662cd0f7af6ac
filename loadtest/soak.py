"""Soak llm_inflight: saturation with random cancellations and disconnects for a set time.

Workers (twice the slots by default) send requests back to back, half on gRPC streams and half as
HTTP generate_stream (SSE). A share of them (`--cancel`) is abandoned after a random number of
pieces: the gRPC stream is cancelled, or the SSE connection closed. Every few seconds the run
records the server's RSS (tritonserver and its stubs, when this command started the server), the
engine's running/waiting/open gauges and KV usage, tokens served and errors. At the end it waits for
the gauges to drain and writes soak.json and soak.png:

    tritonllm-soak --duration 600 --out results/soak          # starts the server (bundled model)
    tritonllm-soak --url 127.0.0.1 --duration 600              # a running server (no RSS)
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests
import tritonclient.grpc as grpcclient

from tritonllm.server.tritonserver import TritonServer, find_free_ports, group_pids
from tritonllm_client.contract import generate_body, grpc_inputs, is_final_response, request_inputs
from tritonllm_loadtest.metrics_scraper import scrape, series

MODEL = "llm_inflight"
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash map works.",
    "List five uses of copper.",
    "What is the capital of Australia, and why was it chosen?",
    "Translate to French: the weather is nice today.",
    "Give three tips for learning to play the piano.",
]
GAUGES = ("tritonllm_num_requests_running", "tritonllm_num_requests_waiting", "tritonllm_num_requests_open",
          "tritonllm_kv_cache_usage_ratio")


@dataclass
class Tally:
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            if error and len(self.error_samples) < 10:
                self.error_samples.append(error[:200])


def _sampling(rng: random.Random) -> dict:
    return {"max_tokens": rng.randint(16, 128), "temperature": 0.7, "seed": rng.randrange(2**31)}


def grpc_request(url: str, rng: random.Random, cancel_after: int | None, tally: Tally, timeout: float) -> None:
    """One request on its own gRPC stream; cancel it after `cancel_after` pieces if set."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    answered = False  # the final response came: a graceful close (cancelling an idle stream delays unloading)
    try:
        inputs = grpc_inputs(request_inputs(rng.choice(PROMPTS), _sampling(rng), stream=True), [1])
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        pieces = 0
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                tally.add("errors", str(error))
                return
            if is_final_response(result.get_response()):
                answered = True
                tally.add("completed")
                return
            pieces += 1
            if cancel_after is not None and pieces >= cancel_after:
                tally.add("cancelled")
                return
    except queue.Empty:
        tally.add("errors", f"no response within {timeout:.0f} s")
    finally:
        client.stop_stream(cancel_requests=not answered)
        client.close()


def sse_request(http_url: str, rng: random.Random, cancel_after: int | None, tally: Tally, timeout: float) -> None:
    """One generate_stream call; close the connection after `cancel_after` events if set."""
    body = generate_body(request_inputs(rng.choice(PROMPTS), _sampling(rng), stream=True))
    try:
        with requests.post(f"http://{http_url}/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                           timeout=timeout) as response:
            events = 0
            for line in response.iter_lines(chunk_size=None):
                if not line.startswith(b"data: "):
                    continue
                if b'"error"' in line:
                    tally.add("errors", line.decode(errors="replace"))
                    return
                events += 1
                if cancel_after is not None and events >= cancel_after:
                    tally.add("cancelled")
                    return
            tally.add("completed")
    except requests.RequestException as exc:
        tally.add("errors", f"{type(exc).__name__}: {exc}")


def group_rss_mb(pgid: int) -> float:
    """Resident memory of every process in a process group (tritonserver and its stubs), in MiB."""
    total_kb = 0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/status") as status:
                total_kb += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        except (OSError, StopIteration):  # gone meanwhile
            continue
    return total_kb / 1024


def run_soak(http_url: str, grpc_url: str, metrics_url: str, duration: float, workers: int, cancel: float,
             interval: float, seed: int, pgid: int | None, quiet: bool = False) -> dict:
    tally = Tally()
    stop = threading.Event()
    timeout = 120.0

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while not stop.is_set():
            cancel_after = rng.randint(0, 8) if rng.random() < cancel else None
            if i % 2:
                grpc_request(grpc_url, rng, cancel_after, tally, timeout)
            else:
                sse_request(http_url, rng, cancel_after, tally, timeout)

    model = {"model": MODEL}
    samples = []
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    try:
        while True:
            elapsed = time.monotonic() - t0
            metrics = scrape(metrics_url)
            sample = {"t": round(elapsed, 1), "rss_mb": round(group_rss_mb(pgid), 1) if pgid else None,
                      "tokens": metrics.get(series("tritonllm_generation_tokens_total", **model), 0.0),
                      **{g: metrics.get(series(g, **model), 0.0) for g in GAUGES},
                      "completed": tally.completed, "cancelled": tally.cancelled, "errors": tally.errors}
            samples.append(sample)
            if not quiet:
                print(f"[{elapsed:6.0f} s] done {tally.completed} cancelled {tally.cancelled} errors {tally.errors} "
                      f"running {sample['tritonllm_num_requests_running']:.0f} "
                      f"waiting {sample['tritonllm_num_requests_waiting']:.0f} rss {sample['rss_mb']} MiB", flush=True)
            if elapsed >= duration:
                break
            time.sleep(min(interval, max(0.0, duration - elapsed)))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=timeout)
    # Drained: every gauge must come back to zero (nothing leaked).
    deadline = time.monotonic() + 60
    while True:
        metrics = scrape(metrics_url)
        left = {g: metrics.get(series(g, **model), 0.0) for g in GAUGES}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    warm = rss[len(rss) // 10:] or rss  # after the first tenth: allocator and caches warmed up
    return {
        "duration_s": round(time.monotonic() - t0, 1), "workers": workers, "cancel_share": cancel,
        "completed": tally.completed, "cancelled": tally.cancelled, "errors": tally.errors,
        "error_samples": tally.error_samples,
        "tokens_served": samples[-1]["tokens"] - samples[0]["tokens"],
        "left_after_drain": left,
        "rss_mb": {"first": rss[0], "after_warmup": warm[0], "last": rss[-1], "max": max(rss),
                   "growth_after_warmup": round(rss[-1] - warm[0], 1)} if rss else None,
        "samples": samples,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    if result["rss_mb"]:
        axes[0].plot(t, [s["rss_mb"] for s in samples])
    axes[0].set_ylabel("RSS (MiB)\nserver + stubs")
    axes[1].plot(t, [s["tokens"] - samples[0]["tokens"] for s in samples], label="tokens served")
    axes[1].set_ylabel("tokens served")
    ax_err = axes[1].twinx()
    ax_err.plot(t, [s["errors"] for s in samples], color="tab:red", label="errors")
    ax_err.set_ylabel("errors", color="tab:red")
    axes[2].plot(t, [s["tritonllm_num_requests_running"] for s in samples], label="running")
    axes[2].plot(t, [s["tritonllm_num_requests_waiting"] for s in samples], label="waiting")
    axes[2].plot(t, [s["tritonllm_kv_cache_usage_ratio"] * 100 for s in samples], label="KV usage %")
    axes[2].legend(loc="upper right")
    axes[2].set_xlabel("seconds")
    fig.suptitle(f"soak: {result['completed']} completed, {result['cancelled']} cancelled, {result['errors']} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Soak llm_inflight with saturation and random cancellations.")
    p.add_argument("--url", help="host of a running server (default: start one on free loopback ports)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--model", default=None, help="model to serve when starting the server (default: bundled)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    p.add_argument("--workers", type=int, default=16, help="concurrent clients (default 16: twice the slots)")
    p.add_argument("--cancel", type=float, default=0.3, help="share of requests abandoned midway (default 0.3)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/soak"))
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    server = None
    if args.url:
        host = args.url
        ports = (args.http_port, args.grpc_port, args.metrics_port)
    else:
        ports = tuple(find_free_ports(3))
        env = {"TRITONLLM_MODEL": args.model} if args.model else {}
        args.out.mkdir(parents=True, exist_ok=True)
        server = TritonServer(http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2], models=[MODEL],
                              env=env, log_file=args.out / "server.log", ready_timeout=300).start()
        host = server.host
    try:
        result = run_soak(f"{host}:{ports[0]}", f"{host}:{ports[1]}", f"http://{host}:{ports[2]}/metrics",
                          args.duration, args.workers, args.cancel, args.interval, args.seed,
                          server.process.pid if server else None, args.quiet)
    finally:
        if server is not None:
            server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary, indent=1))
    leaked = any(result["left_after_drain"].values())
    return 1 if leaked or result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
