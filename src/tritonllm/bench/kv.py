"""`tritonllm-bench-kv`: how many sequences the KV block pool admits, against fixed slots of
max_model_len in the same memory, on a workload's requests (the main job's mix by default).

The engine's own scheduler runs a closed loop of `--users` requests (each finished request is
replaced at once) over the workload's real prompt token counts (bundled tokenizer) and output
lengths; every step computes what the scheduler scheduled, as the engine does. It prints the mean
and peak sequences running at once. Fixed slots of max_model_len hold pool tokens / max_model_len
sequences, whatever their lengths. Pure Python: no model runs, so it takes seconds.

    tritonllm-bench-kv                          # 256 blocks of 64 (llm_inflight's default), 64 users
    tritonllm-bench-kv --output-tokens exp:64:512 --users 128
"""

from __future__ import annotations

import argparse
import statistics

from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import Scheduler, SchedulerConfig
from tritonllm.engine.sequence import Sequence


def closed_loop(config: SchedulerConfig, requests: list[tuple[list[int], int]], users: int) -> list[int]:
    """Sequences running after each step while `users` requests are kept outstanding."""
    scheduler, pending, running_counts = Scheduler(config), list(reversed(requests)), []

    def submit() -> None:
        prompt, max_tokens = pending.pop()
        scheduler.add(Sequence(f"r{len(pending)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))

    for _ in range(min(users, len(pending))):
        submit()
    while scheduler.has_work():
        chunks = scheduler.schedule()
        for c in chunks:
            scheduler.advance(c)
            if c.samples:
                c.seq.output_ids.append(0)
                if len(c.seq.output_ids) >= c.seq.params.max_tokens:
                    scheduler.finish(c.seq, "length")
                    if pending:
                        submit()
        running_counts.append(scheduler.num_running)
    return running_counts


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer
    from tritonllm_loadtest.workload import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_WORDS, Workload

    from tritonllm.model_files import bundled_dir

    p = argparse.ArgumentParser(prog="tritonllm-bench-kv", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=256, help="num_kv_blocks")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256, help="rows at most (high, so memory decides)")
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--output-tokens", default=DEFAULT_OUTPUT_TOKENS)
    p.add_argument("--prompt-words", default=DEFAULT_PROMPT_WORDS)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(bundled_dir())
    workload = Workload(output_tokens=args.output_tokens, prompt_words=args.prompt_words, seed=args.seed)
    # Distinct token ids per request, so that no prompt shares cached blocks with another.
    requests = [([i] * len(tokenizer.encode(spec.prompt)), spec.max_tokens)
                for i, spec in ((i, workload.request(i)) for i in range(args.requests))]
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                             max_num_batched_tokens=max(512, args.max_num_seqs), block_size=args.block_size,
                             num_kv_blocks=args.blocks, enable_prefix_caching=False)
    counts = closed_loop(config, requests, args.users)
    steady = counts[len(counts) // 10: len(counts) * 9 // 10]  # without the ramp and the drain
    fixed = args.blocks * args.block_size // args.max_model_len
    mean = statistics.mean(steady)
    print(f"pool {args.blocks} blocks x {args.block_size} tokens = {args.blocks * args.block_size} tokens; "
          f"{args.users} users, {args.requests} requests ({workload.describe()})")
    print(f"fixed slots of {args.max_model_len} tokens in that memory: {fixed} sequences")
    print(f"block pool: {mean:.1f} sequences running on average (steady part), peak {max(counts)}: "
          f"**{mean / fixed:.1f}x** the fixed slots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
