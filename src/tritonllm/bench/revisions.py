"""`tritonllm-bench-revisions`: the engine at another git revision against this checkout, side by side.

What an engine change costs or gains, measured as serving meets it: the bundled model in the
shipped dtype, llm_inflight's engine settings (model_repository/), a closed loop of `slots` users
on the same requests (`run_closed_loop`: served / in-process measured 0.93-1.07, so this is what
llm_inflight serves), at each slot count and mix. Each run is a fresh process; the two revisions
alternate (A B, then B A, ...) so that a noisy moment of these shared cores touches both alike,
and the table prints the ratio of the medians.

    tritonllm-bench-revisions --against HEAD~1                  # 8 and 32 slots, main and long mix
    tritonllm-bench-revisions --against a0cc23c --slots 8 --mixes long --rounds 3

The other revision is checked out in a temporary `git worktree` (removed at the end) and imported
from there; the workload generator is this checkout's, so both get the same requests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs in a fresh interpreter with the revision's src/ first on sys.path. Only APIs both sides have.
WORKER = r"""
import json, sys
import tritonllm
from tritonllm.bench.engine import make_workload, run_closed_loop
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.engine.model_loader import load_model

cfg = json.loads(sys.argv[1])

def build():
    model, tokenizer = load_model("bundled", "cpu", "auto")
    return LLMEngine(model, tokenizer, SchedulerConfig(**cfg["engine"]))

engine = LLMEngine.start_in_thread(build)
try:
    workload = make_workload(cfg["requests"], cfg["output_tokens"], cfg["prompt_words"], cfg["seed"])
    slots = cfg["engine"]["max_num_seqs"]
    run_closed_loop(engine, workload[:slots], slots)  # warm-up
    result = run_closed_loop(engine, workload, slots)
finally:
    engine.shutdown()
print("RESULT " + json.dumps({**result, "module": tritonllm.__file__}), flush=True)
"""


def run_once(src: Path, config: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(config)], env=env, capture_output=True,
                          text=True, timeout=1800)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"error: the run from {src} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(line[len("RESULT "):])
    if not Path(result["module"]).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"error: the run meant for {src} imported tritonllm from {result['module']}")
    return result


def main(argv: list[str] | None = None) -> int:
    from tritonllm.bench.peers.bench import engine_settings, mixes
    from tritonllm.server.tritonserver import DEFAULT_MODEL_REPOSITORY

    parser = argparse.ArgumentParser(prog="tritonllm-bench-revisions", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git revision to compare this checkout with")
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--mixes", nargs="+", default=["main", "long"], choices=sorted(mixes()))
    parser.add_argument("--requests-per-slot", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each revision per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    here = Path(__file__).resolve().parents[2]  # the checkout: src/tritonllm/ -> .
    settings = engine_settings(DEFAULT_MODEL_REPOSITORY)
    results = []
    with tempfile.TemporaryDirectory(prefix="tritonllm-rev-") as tmp:
        other = Path(tmp) / "checkout"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "--detach", "--quiet", str(other), args.against],
                       check=True)
        try:
            sides = {"this": here / "src", args.against: other / "src"}
            for mix in args.mixes:
                output_tokens, prompt_words = mixes()[mix]
                for slots in args.slots:
                    config = {"engine": {**settings, "max_num_seqs": slots}, "requests": slots * args.requests_per_slot,
                              "output_tokens": output_tokens, "prompt_words": prompt_words, "seed": args.seed}
                    runs: dict[str, list[dict]] = {name: [] for name in sides}
                    for round_ in range(args.rounds):
                        order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
                        for name in order:
                            r = run_once(sides[name], config)
                            runs[name].append(r)
                            print(f"{mix} {slots:3d} slots  {name:>12s}: {r['tokens_per_s']:7.1f} tok/s  "
                                  f"TTFT p50 {r['ttft_p50'] * 1e3:6.0f} ms", flush=True)
                    cell = {"mix": mix, "slots": slots, "output_tokens": output_tokens, "prompt_words": prompt_words,
                            **{f"{name}_tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs)
                               for name, rs in runs.items()},
                            **{f"{name}_ttft_p50": statistics.median(x["ttft_p50"] for x in rs)
                               for name, rs in runs.items()}}
                    cell["ratio"] = cell["this_tokens_per_s"] / cell[f"{args.against}_tokens_per_s"]
                    results.append(cell)
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(other)], check=False)
    print(f"\nthis checkout against {args.against} (medians of {args.rounds} runs each, tokens/s; "
          f"TTFT p50 in ms)")
    print(f"{'mix':6s} {'slots':>5s} {'this':>8s} {args.against:>12s} {'ratio':>6s} {'TTFT this':>10s} {'other':>8s}")
    for c in results:
        print(f"{c['mix']:6s} {c['slots']:5d} {c['this_tokens_per_s']:8.1f} {c[f'{args.against}_tokens_per_s']:12.1f} "
              f"{c['ratio']:6.3f} {c['this_ttft_p50'] * 1e3:10.0f} {c[f'{args.against}_ttft_p50'] * 1e3:8.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"against": args.against, "cells": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
