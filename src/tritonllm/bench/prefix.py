"""`tritonllm-bench-prefix`: what automatic prefix caching buys llm_inflight when prompts share a
system prompt, served: the same requests through the same Locust users (`tritonllm-compare`),
against a tritonserver with caching on and one with it off, alternating (on, off, off, on, ...) so
that a noisy moment of these shared cores touches both alike.

    tritonllm-bench-prefix                                   # ~1,000 shared tokens, 80 % of each prompt, 8 users
    tritonllm-bench-prefix --shared-words 400 --prompt-words uniform:300:400 --users 32

Prints median TTFT and output tokens/s of each run, and the ratios of their medians. A benchmark,
not a test: minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tritonllm.bench.results import write_results
from tritonllm.server.repository import configured_repository
from tritonllm.server.tritonserver import TritonServer, find_free_ports


def log(msg: str) -> None:
    print(f"[bench-prefix] {msg}", file=sys.stderr, flush=True)


def compare_run(out: Path, triton: TritonServer, args) -> dict:
    from tritonllm_loadtest import compare

    argv = ["--server", "never", "--url", triton.http_url, "--grpc-url", triton.grpc_url,
            "--metrics-url", f"http://{triton.host}:{triton.metrics_port}/metrics", "--schemes", "inflight",
            "--concurrency", str(args.users), "--max-requests", str(args.requests), "--run-time", "900",
            "--output-tokens", args.output_tokens, "--prompt-words", args.prompt_words,
            "--shared-prefix-words", str(args.shared_words), "--seed", str(args.seed), "--quick", "--out", str(out)]
    if compare.main(argv) != 0:
        raise SystemExit(f"error: tritonllm-compare failed, see {out}")
    return json.loads((out / "summary.json").read_text())["runs"][0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonllm-bench-prefix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # 800 words of the shipped prompts are ~990 tokens of the bundled tokenizer, 80 % of each prompt
    p.add_argument("--shared-words", type=int, default=800, help="words of the shared system prompt")
    p.add_argument("--prompt-words", default="uniform:170:200", help="each request's own words after it")
    p.add_argument("--output-tokens", default="exp:32:128")
    p.add_argument("--users", type=int, default=8, help="closed-loop users = max_num_seqs")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2, help="runs with caching on, and as many off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="results directory (default results/prefix-<timestamp>)")
    args = p.parse_args(argv)
    out = (args.out or Path("results") / time.strftime("prefix-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    order = [("on", "off") if r % 2 == 0 else ("off", "on") for r in range(args.rounds)]
    for r, pair in enumerate(order):
        for caching in pair:
            repository = configured_repository(out / f"repository-{caching}-{r}", {"llm_inflight": {
                "max_num_seqs": str(args.users), "enable_prefix_caching": "true" if caching == "on" else "false"}})
            http, grpc, metrics = find_free_ports(3)
            with TritonServer(repository, http_port=http, grpc_port=grpc, metrics_port=metrics,
                              log_file=out / f"triton-{caching}-{r}.log", ready_timeout=600) as triton:
                summary = compare_run(out / f"run-{caching}-{r}", triton, args)
            runs[caching].append(summary)
            log(f"caching {caching}: TTFT p50 {summary['ttft_p50']:.3f} s, {summary['tokens_per_s']:.1f} tok/s")
    med = {k: {m: statistics.median(s[m] for s in v) for m in ("ttft_p50", "tokens_per_s")} for k, v in runs.items()}
    lines = [f"shared prefix {args.shared_words} words + {args.prompt_words} own words, output {args.output_tokens}, "
             f"{args.users} users, {args.requests} requests, {args.rounds} runs each (medians)",
             "| prefix caching | TTFT p50 (s) | output tok/s |", "|---|---:|---:|"]
    for k in ("on", "off"):
        lines.append(f"| {k} | {med[k]['ttft_p50']:.3f} | {med[k]['tokens_per_s']:.1f} |")
    lines.append(f"\nTTFT off / on: **{med['off']['ttft_p50'] / med['on']['ttft_p50']:.2f}x**; "
                 f"tokens/s on / off: **{med['on']['tokens_per_s'] / med['off']['tokens_per_s']:.2f}x**")
    write_results(out, runs, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
