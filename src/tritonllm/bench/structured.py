"""`tritonllm-bench-structured`: what constrained decoding costs the engine, side by side in one
process: the same batch of requests run plain and with a share of its rows constrained,
alternating (plain, constrained, constrained, plain, ...) so that a noisy moment touches both.

    tritonllm-bench-structured                          # 32 rows, half of them constrained, 64 tokens each
    tritonllm-bench-structured --rows 8 --constrained 1.0 --tokens 128

Every request generates exactly `--tokens` tokens (ignore_eos; the constraint is a regex that
cannot end before them), so the two runs do the same work but for the masks. Prints tokens/s of
each run and the ratio of their medians. A benchmark, not a test: minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tritonllm.bench.results import write_results

# Text the model writes anyway (words, spaces, punctuation), long enough never to end first: the mask
# is computed on every token, and no row finishes early.
REGEX = r"[A-Za-z ,.'\n]{1,4096}"
SCHEMA_ROW = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4096}}, "required": ["story"]}


def log(msg: str) -> None:
    print(f"[bench-structured] {msg}", file=sys.stderr, flush=True)


def run_once(engine, prompts: list[str], params: list) -> float:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    short = [o.request_id for o, p in zip(outs, params) if len(o.token_ids) != p.max_tokens]
    if short:  # the runs would not do the same work
        raise SystemExit(f"error: {len(short)} rows ended before max_tokens ({outs[0].finish_reason}); "
                         "the constraint must not let a row end early")
    return sum(len(o.token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> int:
    from tritonllm.engine.llm_engine import LLMEngine
    from tritonllm.engine.sampling_params import SamplingParams

    p = argparse.ArgumentParser(prog="tritonllm-bench-structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--dtype", default=None, help="auto (default), float32 or bfloat16")
    p.add_argument("--rows", type=int, default=32, help="requests in the batch (and engine slots)")
    p.add_argument("--constrained", type=float, default=0.5, help="share of the rows constrained")
    p.add_argument("--kind", choices=("regex", "json"), default="regex",
                   help="regex: free text under a character class; json: a string field of a schema")
    p.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs (plain, constrained, then reversed)")
    p.add_argument("--out", type=Path, default=Path("bench-structured"))
    args = p.parse_args(argv)
    engine = LLMEngine.from_spec(args.model, dtype=args.dtype, max_num_seqs=args.rows, max_model_len=1024)
    tokenizer = engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me story number {i}."}],
                                             tokenize=False, add_generation_prompt=True) for i in range(args.rows)]
    spec = {"regex": REGEX} if args.kind == "regex" else {"json": SCHEMA_ROW}
    base = dict(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    plain = [SamplingParams(**base) for _ in prompts]
    constrained_rows = round(args.rows * args.constrained)
    constrained = [SamplingParams(**base, structured_outputs=spec) if i < constrained_rows else SamplingParams(**base)
                   for i in range(args.rows)]
    run_once(engine, prompts[:2], constrained[:2])  # warm-up: kernels compiled, the grammar cached
    speeds: dict[str, list[float]] = {"plain": [], "constrained": []}
    for r in range(args.rounds):
        for name in (("plain", "constrained") if r % 2 == 0 else ("constrained", "plain")):
            speed = run_once(engine, prompts, plain if name == "plain" else constrained)
            speeds[name].append(speed)
            log(f"round {r + 1}: {name} {speed:.1f} tok/s")
    medians = {name: statistics.median(v) for name, v in speeds.items()}
    ratio = medians["constrained"] / medians["plain"]
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"rows": args.rows, "constrained_rows": constrained_rows, "kind": args.kind, "spec": spec,
            "tokens": args.tokens, "dtype": str(engine.runner.dtype), "speeds": speeds, "medians": medians,
            "ratio": ratio}
    table = (f"| rows | constrained | tokens | plain tok/s | constrained tok/s | ratio |\n|---:|---:|---:|---:|---:|---:|\n"
             f"| {args.rows} | {constrained_rows} ({args.kind}) | {args.tokens} | {medians['plain']:.1f} | "
             f"{medians['constrained']:.1f} | {ratio:.3f} |")
    write_results(args.out, data, table)
    print(table)
    print(json.dumps({"ratio": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
