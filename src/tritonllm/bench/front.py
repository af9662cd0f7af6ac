"""`tritonllm-bench-front`: what the OpenAI-compatible front costs, measured at the same moment.

Half of the users stream from llm_inflight through the front (Locust's OpenAI SSE user), the other
half at the same time straight from Triton (its HTTP SSE user on `generate_stream`): two
`tritonllm-compare` runs side by side against one tritonserver and one front, so both halves share
the engine's steps, the cores and the machine's moment. Runs one after the other were no use on
these shared cores: the same direct run gave 156 and 216 tok/s five minutes apart.

    tritonllm-bench-front                          # 8 and 32 users in all, 2 rounds
    tritonllm-bench-front --users 64 --rounds 3

Only requests that start and end while both halves run are counted. Prints each half's output
tokens/s and median TTFT, and front / direct, per round and pooled over the rounds: a round's
median TTFT difference moves by +-8 ms on these cores (the moment in the engine's step at which
each request lands), so the pooled line gives the difference of the medians over every round's
requests with a 95 % bootstrap interval. A benchmark, not a test: minutes of CPU.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tritonllm.bench.results import write_results
from tritonllm.server.children import die_with_parent
from tritonllm.server.openai_front import OpenAIFront
from tritonllm.server.tritonserver import TritonServer, find_free_ports
from tritonllm_loadtest.samples import Sample, load_samples

HALVES = ("triton", "openai")  # tritonllm-compare --via


def log(msg: str) -> None:
    print(f"[bench-front] {msg}", file=sys.stderr, flush=True)


def compare_command(triton: TritonServer, front: OpenAIFront, via: str, users: int, requests: int, out: Path,
                    args) -> list[str]:
    return [sys.executable, "-m", "tritonllm_loadtest.compare", "--server", "never", "--url", triton.http_url,
            "--grpc-url", triton.grpc_url, "--metrics-url", f"http://{triton.host}:{triton.metrics_port}/metrics",
            "--via", via, "--front-url", front.root, "--protocol", "http",
            "--schemes", "inflight", "--quick", "--concurrency", str(users), "--max-requests", str(requests),
            "--output-tokens", args.output_tokens, "--seed", str(args.seed), "--quiet", "--out", str(out)]


def overlap(halves: dict[str, list[Sample]]) -> tuple[float, float]:
    """The window in which both halves were sending: from the later first start to the earlier last end."""
    return (max(min(s.start for s in v) for v in halves.values()),
            min(max(s.end for s in v) for v in halves.values()))


def side_by_side(halves: dict[str, list[Sample]]) -> dict:
    """Each half's output tokens/s and TTFT over the requests inside the common window."""
    lo, hi = overlap(halves)
    if hi <= lo:
        raise SystemExit("error: the two halves never ran at the same time")
    out = {"window_s": hi - lo}
    for via, samples in halves.items():
        inside = [s for s in samples if s.ok and s.ttft is not None and s.start >= lo and s.end <= hi]
        if not inside:
            raise SystemExit(f"error: no {via} request ran inside the common window; give more --requests-per-user")
        out[via] = {"requests": len(inside), "tokens": sum(s.output_tokens for s in inside),
                    "tokens_per_s": sum(s.output_tokens for s in inside) / (hi - lo),
                    "ttft_p50": statistics.median(s.ttft for s in inside), "ttfts": [s.ttft for s in inside]}
    return with_front_cost(out)


def with_front_cost(out: dict) -> dict:
    """Adds what the front costs: its tokens/s over the direct half's, its median TTFT minus theirs."""
    out["tokens_ratio"] = out["openai"]["tokens_per_s"] / out["triton"]["tokens_per_s"]
    out["ttft_p50_delta"] = out["openai"]["ttft_p50"] - out["triton"]["ttft_p50"]
    return out


def pooled(rounds: list[dict], resamples: int = 2000, seed: int = 0) -> dict:
    """The rounds of one user count together: each half's tokens over the summed windows, the
    difference of the medians of all counted TTFTs, and its 95 % bootstrap interval (each half's
    TTFTs resampled with replacement)."""
    window = sum(r["window_s"] for r in rounds)
    out = {"rounds": len(rounds)}
    for via in HALVES:
        out[via] = {"requests": sum(r[via]["requests"] for r in rounds),
                    "tokens_per_s": sum(r[via]["tokens"] for r in rounds) / window,
                    "ttft_p50": statistics.median(t for r in rounds for t in r[via]["ttfts"])}
    with_front_cost(out)
    rng = np.random.default_rng(seed)
    medians = {via: np.median(rng.choice(np.array([t for r in rounds for t in r[via]["ttfts"]]),
                                         (resamples, out[via]["requests"])), axis=1) for via in HALVES}
    out["ttft_p50_delta_ci95"] = tuple(float(x) for x in np.percentile(medians["openai"] - medians["triton"], [2.5, 97.5]))
    return out


def run_pair(triton: TritonServer, front: OpenAIFront, users: int, out: Path, args) -> dict:
    half = users // 2
    procs = {}
    for via in HALVES:
        cmd = compare_command(triton, front, via, half, half * args.requests_per_user, out / via, args)
        procs[via] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out.parent / f"{out.name}-{via}.log", "w"),
                                      preexec_fn=die_with_parent)
    for via, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"error: tritonllm-compare --via {via} failed, see {out.parent / f'{out.name}-{via}.log'}")
    return side_by_side({via: load_samples((out / via / "runs").glob("*/samples.jsonl")) for via in HALVES})


def markdown(results: list[dict], args) -> list[str]:
    lines = [f"front (OpenAI SSE) and direct (Triton generate_stream SSE) users at the same time against one "
             f"llm_inflight, half each; output {args.output_tokens}; counted: requests inside the common window",
             "", "| users in all | round | direct tok/s | front tok/s | front / direct | direct TTFT p50 (ms) | "
             "front TTFT p50 (ms) | front - direct (ms) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['users']} | {r['round']} | {r['triton']['tokens_per_s']:.1f} | "
                     f"{r['openai']['tokens_per_s']:.1f} | **{r['tokens_ratio']:.2f}x** | "
                     f"{r['triton']['ttft_p50'] * 1000:.1f} | {r['openai']['ttft_p50'] * 1000:.1f} | "
                     f"**{r['ttft_p50_delta'] * 1000:+.1f}** |")
    for users in dict.fromkeys(r["users"] for r in results):
        p = pooled([r for r in results if r["users"] == users])
        lo, hi = p["ttft_p50_delta_ci95"]
        lines.append(f"| {users} | pooled ({p['rounds']}) | {p['triton']['tokens_per_s']:.1f} | "
                     f"{p['openai']['tokens_per_s']:.1f} | **{p['tokens_ratio']:.2f}x** | "
                     f"{p['triton']['ttft_p50'] * 1000:.1f} | {p['openai']['ttft_p50'] * 1000:.1f} | "
                     f"**{p['ttft_p50_delta'] * 1000:+.1f}** (95 %: {lo * 1000:+.1f} to {hi * 1000:+.1f}) |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonllm-bench-front", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", default="8,32", help="users in all per run, half through the front (even numbers)")
    p.add_argument("--requests-per-user", type=int, default=25)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output-tokens", default="exp:48:256", help="as tritonllm-compare's (its default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results directory (default results/front-<timestamp>)")
    args = p.parse_args(argv)
    users = [int(u) for u in args.users.split(",")]
    if any(u < 2 or u % 2 for u in users):
        p.error("--users: even numbers of at least 2 (half go through the front)")
    out = (args.out or Path("results") / time.strftime("front-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    http, grpc, metrics, openai = find_free_ports(4)
    results = []
    with TritonServer(http_port=http, grpc_port=grpc, metrics_port=metrics, models=["llm_inflight"],
                      log_file=out / "tritonserver.log", ready_timeout=600) as triton, \
            OpenAIFront(triton.grpc_url, port=openai, models=["llm_inflight"], log_file=out / "front.log") as front:
        for r in range(1, args.rounds + 1):
            for u in users:
                result = {"users": u, "round": r, **run_pair(triton, front, u, out / f"u{u}-r{r}", args)}
                results.append(result)
                log(f"{u} users, round {r}: front / direct {result['tokens_ratio']:.2f}x tok/s, "
                    f"TTFT p50 {result['ttft_p50_delta'] * 1000:+.1f} ms")
    lines = markdown(results, args)
    write_results(out, results, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
