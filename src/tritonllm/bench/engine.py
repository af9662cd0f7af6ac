"""`tritonllm-bench-engine`: offline throughput of four ways to batch the same workload, in one run.

0. decode: the model runner's decode step alone at 8 and 32 slots (ms, tok/s, GB/s of weights), and
   7 short rows + 1 long against 8 short; on CPU in bf16 each also with PyTorch's ops between the
   matmuls instead of the compiled layer kernels (kernels/layer_kernels.py), side by side;
   prefill: a lone prompt's prefill (256 and 1,280 tokens cold, 256 after 1,024 cached), with
   batch invariance on and, where it costs matmul calls (AMX), off, side by side;
   linears / native (only when named in --only): the native bf16 linear against the path it
   replaces (bench/kernels.py);
1. ceiling: the engine's model runner doing decode steps for a full batch of slots, nothing else;
2. engine: the in-flight engine (scheduling, chunked prefill, sampling, detokenizing);
   request: the same engine with request-level batches (what llm_dynamic / llm_static run);
3. hf-cb: transformers' own continuous batching (ContinuousBatchingManager, explicit cache sizes);
4. static: `model.generate` on fixed batches, each run until its longest member ends.
All get the same requests: varied prompt lengths and heavy-tailed (capped exponential) output
lengths forced with max_tokens + ignore_eos. Output tokens/s counts only requested tokens.

The model runs in `--dtype` (auto: bfloat16 where the CPU has native bf16, as the served models
do). `--vs float32` / `--vs int8` also run the ceiling and the engine in float32, or with
int8 matmuls (quantization.py), in the same run, for the ratios. `--match N` measures batch invariance:
N chat prompts, greedy, through the engine at full batch and one by one through the same model's
`model.generate` (for int8: the unquantised model): how many answers are token-identical.

`--profile-steps FILE` instead times the runner's forward over a grid of step shapes (rows,
decode context, a prefill chunk) and writes them as JSON: the step-cost profile that
`tritonllm-simulate` fits and interpolates (tritonllm/capacity/step_cost.py).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time

import torch

from tritonllm.bench.kernels import print_linears, print_native_vs_previous, run_linears, run_native_vs_previous
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.model_runner import Chunk, ModelRunner
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.engine.model_loader import DTYPES, dtype_name, load_model, resolve_dtype

def make_workload(n: int, output_tokens: str, prompt_words: str, seed: int) -> list[tuple[str, int]]:
    """(prompt, output length) pairs: the load test's own workload (shipped prompts), so both agree."""
    from tritonllm_loadtest.workload import Workload

    workload = Workload(output_tokens=output_tokens, prompt_words=prompt_words, seed=seed)
    return [(spec.prompt, spec.max_tokens) for spec in map(workload.request, range(n))]


def run_engine(model, tokenizer, workload, slots: int, budget: int, policy: str = "continuous",
               quantization: str | None = None) -> dict:
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=slots, max_model_len=1024,
                                                         max_num_batched_tokens=budget, batch_policy=policy),
                       quantization)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for _, n in workload]
    busy_tokens = busy_slot_steps = 0
    busy_seconds = 0.0
    start = time.perf_counter()
    for (prompt, _), p in zip(workload, params):
        engine.add_request(prompt, p)
    while engine.has_unfinished():
        waiting = engine.num_waiting > 0
        before, step_start = engine.stats.tokens_generated, time.perf_counter()
        engine.step()
        if waiting:  # steady state: requests wait for a slot, as under sustained load
            busy_tokens += engine.stats.tokens_generated - before
            busy_slot_steps += slots
            busy_seconds += time.perf_counter() - step_start
    elapsed = time.perf_counter() - start
    tokens = engine.stats.tokens_generated
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "tokens_per_s_while_waiting": busy_tokens / busy_seconds if busy_seconds else None,
            "waste": engine.stats.waste, "occupancy": engine.stats.occupancy,
            "slot_utilisation_while_waiting": busy_tokens / busy_slot_steps if busy_slot_steps else None,
            "steps": engine.stats.steps}


def run_ceiling(model, tokenizer, workload, slots: int, quantization: str | None = None) -> dict:
    """Decode steps for a full batch of slots at the workload's context lengths; no prefill."""
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=slots, max_model_len=1024,
                                                         max_num_batched_tokens=max(slots, 64)), quantization)
    prompt_lens = [len(tokenizer.encode(p)) for p, _ in workload]
    total = sum(n for _, n in workload)
    steps = -(-total // slots)
    lengths = [prompt_lens[i % len(prompt_lens)] for i in range(slots)]
    start = time.perf_counter()
    for _ in range(steps):
        engine.runner.decode_ceiling_step(lengths)
        lengths = [length + 1 for length in lengths]
    elapsed = time.perf_counter() - start
    return {"tokens": steps * slots, "seconds": elapsed, "tokens_per_s": steps * slots / elapsed, "steps": steps}


def run_closed_loop(engine: LLMEngine, workload, users: int) -> dict:
    """`users` clients, each sending its next request when its last one ends, to a running engine's own
    thread (what Locust's closed loop does to llm_inflight, without Triton, gRPC or Locust): the
    in-process side of served / in-process. Start the engine as llm_inflight does
    (`LLMEngine.start_in_thread`: torch only on the engine's thread)."""
    finished: queue.Queue = queue.Queue()
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for _, n in workload]
    pending = iter(zip(workload, params))
    ttfts = []

    def on_output(out) -> None:
        if out.finished:
            finished.put(out)

    def send() -> bool:
        item = next(pending, None)
        if item is not None:
            (prompt, _), p = item
            engine.add_request(prompt, p, on_output)
        return item is not None

    start = time.perf_counter()
    in_flight = sum(send() for _ in range(users))
    tokens = 0
    while in_flight:
        out = finished.get(timeout=600)
        if out.error:
            raise RuntimeError(f"in-process request failed: {out.error}")
        tokens += out.num_output_tokens
        ttfts.append(out.first_token_time - out.arrival_time)
        in_flight += send() - 1
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "ttft_p50": statistics.median(ttfts), "requests": len(ttfts)}


DECODE_CASES = [("8 x 128", [128] * 8), ("32 x 128", [128] * 32), ("8 x 32", [32] * 8),
                ("7 x 32 + 1 x 1600", [32] * 7 + [1600]), ("8 x 1600", [1600] * 8)]


def run_decode_steps(model, quantization: str | None = None, repeats: int = 10) -> dict:
    """The runner's decode step alone at 8 and 32 slots: time, tok/s and the weights' bytes per step
    time (GB/s: how close the step comes to streaming its weights at memory speed), and one long row
    among short ones against all short (attention that follows true lengths costs little more).
    Where the compiled layer kernels run (kernels/layer_kernels.py: CPU, bf16), every case is also
    timed with PyTorch's ops between the matmuls instead, alternating in the same process
    (`torch_ops_over_kernels`: what the kernels save a step)."""
    runner = ModelRunner(model, max(len(lengths) for _, lengths in DECODE_CASES), 2048, quantization)
    kernels = [True, False] if runner.cpu_kernels else [False]
    times = {(name, k): [] for name, _ in DECODE_CASES for k in kernels}
    for k in kernels:  # warm every shape
        runner.cpu_kernels = k
        for _, lengths in DECODE_CASES:
            runner.decode_ceiling_step(lengths)
    for rep in range(repeats):  # round robin: a noisy moment touches every case and variant alike
        for k in kernels if rep % 2 else kernels[::-1]:
            runner.cpu_kernels = k
            for name, lengths in DECODE_CASES:
                t0 = time.perf_counter()
                runner.decode_ceiling_step(lengths)
                times[(name, k)].append(time.perf_counter() - t0)
    runner.cpu_kernels = kernels[0]
    cases = {}
    for name, lengths in DECODE_CASES:
        seconds = statistics.median(times[(name, kernels[0])])
        cases[name] = {"rows": len(lengths), "seconds": seconds, "tokens_per_s": len(lengths) / seconds,
                       "weights_gb_per_s": runner.weight_bytes / seconds / 1e9}
        if len(kernels) == 2:
            cases[name]["torch_ops_seconds"] = statistics.median(times[(name, False)])
            cases[name]["torch_ops_over_kernels"] = cases[name]["torch_ops_seconds"] / seconds
    mixed = cases["7 x 32 + 1 x 1600"]["seconds"] / cases["8 x 32"]["seconds"]
    return {"weight_bytes": runner.weight_bytes, "cpu_kernels": kernels[0], "paged_decode": runner.paged_decode,
            "cases": cases, "mixed_over_short": mixed}


def print_decode_steps(r: dict) -> None:
    between = "compiled layer kernels" if r["cpu_kernels"] else "PyTorch ops"
    attention = "paged decode attention" if r["paged_decode"] else "flash decode attention"
    print(f"decode steps (weights {r['weight_bytes'] / 1e6:.0f} MB per step, {between} between the matmuls, "
          f"{attention}):")
    for name, c in r["cases"].items():
        torch_ops = (f"  | PyTorch ops {c['torch_ops_seconds'] * 1e3:6.1f} ms, {c['torch_ops_over_kernels']:.2f}x the time"
                     if "torch_ops_seconds" in c else "")
        print(f"  {name:18s} {c['seconds'] * 1e3:6.1f} ms  {c['tokens_per_s']:7.1f} tok/s  "
              f"{c['weights_gb_per_s']:5.1f} GB/s of weights{torch_ops}")
    print(f"  7 x 32 + 1 x 1600 / 8 x 32 = {r['mixed_over_short']:.2f}", flush=True)


PREFILL_CASES = [("cold 256", [(0, 256)]), ("cold 1280", [(0, 512), (512, 512), (1024, 256)]),
                 ("256 after 1024 cached", [(1024, 256)])]  # (start, tokens) of each step: chunks of 512


def run_prefill_steps(model, quantization: str | None = None, repeats: int = 5) -> dict:
    """A lone prompt's prefill, the time to its first token in-process: cold prompts of 256 and 1,280
    tokens (in the shipped llm_inflight's chunks of 512) and a prefix-cache hit (256 new tokens after
    1,024 cached). Where batch invariance costs matmul calls (AMX), each case is also timed with it
    off, alternating in the same process (`invariant_over_one_call`)."""
    runner = ModelRunner(model, 1, 2048, quantization)
    blocks = runner.slot_blocks(0)
    ids = [(100 + i) % model.config.vocab_size for i in range(2048)]
    variants = [True, False] if runner.row_block is not None else [True]

    def prefill(steps) -> None:
        for start, n in steps:
            runner.forward([Chunk(blocks, ids[start:start + n], start, True)])

    times = {(name, v): [] for name, _ in PREFILL_CASES for v in variants}
    for rep in range(repeats + 1):  # the first round warms every shape
        for v in variants if rep % 2 else variants[::-1]:
            runner.batch_invariant = v
            for name, steps in PREFILL_CASES:
                t0 = time.perf_counter()
                prefill(steps)
                if rep:
                    times[(name, v)].append(time.perf_counter() - t0)
    cases = {}
    for name, steps in PREFILL_CASES:
        seconds = statistics.median(times[(name, True)])
        tokens = sum(n for _, n in steps)
        cases[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        if len(variants) == 2:
            cases[name]["invariant_over_one_call"] = seconds / statistics.median(times[(name, False)])
    return {"cases": cases}


def print_prefill_steps(r: dict) -> None:
    print("prefill of a lone prompt (chunks of 512):")
    for name, c in r["cases"].items():
        cost = (f"  | batch invariance costs {c['invariant_over_one_call']:.2f}x the time of one call a weight"
                if "invariant_over_one_call" in c else "")
        print(f"  {name:22s} {c['seconds'] * 1e3:7.1f} ms  {c['tokens_per_s']:7.1f} prompt tok/s{cost}", flush=True)


def run_static(model, tokenizer, workload, slots: int) -> dict:
    """Fixed batches of `slots` requests in arrival order, each run until its longest member ends."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    start = time.perf_counter()
    for i in range(0, len(workload), slots):
        batch = workload[i:i + slots]
        enc = tokenizer([p for p, _ in batch], return_tensors="pt", padding=True)
        longest = max(n for _, n in batch)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in workload)  # only what was asked for counts
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def run_hf_continuous(model, tokenizer, workload, slots: int, budget: int) -> dict:
    """transformers' continuous batching with explicit sizes (else it sizes its cache from RAM)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(n for _, n in workload)
    gen = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=None,
                           pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    cb = ContinuousBatchingConfig(page_size=64, num_blocks=slots * 16, max_batch_tokens=budget,
                                  max_requests_per_batch=slots)
    prompts = [tokenizer.encode(p) for p, _ in workload]
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    start = time.perf_counter()
    manager.start()
    for i, (ids, (_, n)) in enumerate(zip(prompts, workload)):
        manager.add_request(ids, request_id=f"r{i}", max_new_tokens=n)
    tokens = 0
    for _ in workload:
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers continuous batching returned no result within 600 s")
        tokens += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def run_match(model, tokenizer, workload, slots: int, max_tokens: int, quantization: str | None = None) -> dict:
    """Greedy answers of the engine (all prompts queued at once, `slots` at a time) against unbatched
    `model.generate`, token for token: the batch invariance of the kernels in this dtype."""
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=False) if tokenizer.chat_template else p for p, _ in workload]
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=slots, max_model_len=1024,
                                                         max_num_batched_tokens=256), quantization)
    batched = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    eos = engine.sampler.eos_token_ids
    identical, prefixes = 0, []
    for prompt, out in zip(prompts, batched):
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False)[0, len(ids):].tolist()
        ref = next((ref[:i + 1] for i, t in enumerate(ref) if t in eos), ref)
        common = next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), min(len(ref), len(out.token_ids)))
        identical += out.token_ids == ref
        prefixes.append(common)
    return {"identical": identical, "prompts": len(prompts), "tokens": max_tokens,
            "mean_common_prefix": sum(prefixes) / len(prefixes)}


def profile_steps(runner, slots: int, contexts=(32, 128, 384), prefills=(0, 32, 128, 256),
                  repeats: int = 5) -> list[dict]:
    """Median forward time of each step shape: `rows` rows, of which one is a prefill chunk of `p` prompt
    tokens (when p > 0) and the rest decode one token at context `ctx`."""
    rows_options = sorted({r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256) if r <= slots} | {slots})
    out = []
    for rows in rows_options:
        for ctx in contexts:
            for p in prefills:
                decodes = rows - 1 if p else rows
                chunks = [Chunk(runner.slot_blocks(i), [1], ctx, True) for i in range(decodes)]
                if p:
                    chunks.append(Chunk(runner.slot_blocks(decodes), [1] * p, 0, True))
                runner.forward(chunks)  # warm this shape
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    runner.forward(chunks)
                    times.append(time.perf_counter() - t0)
                out.append({"rows": rows, "new_tokens": decodes + p, "context": decodes * (ctx + 1) + p,
                            "decode_context": ctx, "prefill": p, "seconds": statistics.median(times)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonllm-bench-engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="bundled, tiny, a HF directory or hub id")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--slots", type=int, default=8, help="max_num_seqs = static batch size")
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    parser.add_argument("--output-tokens", default="exp:48:192",
                        help="output length distribution: fixed:N, uniform:A:B or exp:MEAN:CAP (capped exponential)")
    parser.add_argument("--prompt-words", default="uniform:8:48", help="prompt length distribution, in words")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 on CPUs with native bf16), float32, bfloat16")
    parser.add_argument("--quantization", default="none", choices=["none", "int8"], help="of the main runs")
    parser.add_argument("--vs", action="append", default=[], choices=["float32", "int8"],
                        help="also run the ceiling and the engine in float32, or with int8 weights (repeatable)")
    parser.add_argument("--match", type=int, default=0, metavar="N",
                        help="greedy batch invariance on N chat prompts (40 tokens each), per dtype run")
    sections = ["decode", "prefill", "linears", "native", "ceiling", "engine", "request", "hf-cb", "static"]
    parser.add_argument("--skip", nargs="*", default=[], choices=sections)
    parser.add_argument("--only", nargs="*", default=[], choices=sections, help="run only these sections")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--profile-steps", metavar="FILE",
                        help="only time the runner's forward over a grid of step shapes and write them here "
                             "(the step-cost profile of tritonllm-simulate)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = resolve_dtype(DTYPES.get(args.dtype, args.dtype), device)  # an explicit --dtype beats TRITONLLM_DTYPE
    model, tokenizer = load_model(args.model, device, dtype)
    if args.profile_steps:
        engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=args.slots, max_model_len=1024,
                                                             max_num_batched_tokens=max(args.budget, args.slots)),
                           args.quantization)
        t0 = time.perf_counter()
        measurements = profile_steps(engine.runner, args.slots)
        with open(args.profile_steps, "w") as f:
            json.dump({"model": args.model, "device": device, "dtype": dtype_name(dtype),
                       "quantization": args.quantization, "slots": args.slots, "threads": torch.get_num_threads(),
                       "measurements": measurements}, f, indent=2)
        print(f"{len(measurements)} step shapes timed in {time.perf_counter() - t0:.0f} s -> {args.profile_steps}")
        return 0
    workload = make_workload(args.requests, args.output_tokens, args.prompt_words, args.seed)
    print(f"model={args.model} dtype={dtype_name(dtype)} ({args.dtype}) quantization={args.quantization} "
          f"device={device} requests={args.requests} "
          f"slots={args.slots} budget={args.budget} output tokens={sum(n for _, n in workload)} "
          f"({args.output_tokens}), prompt words {args.prompt_words}, threads={torch.get_num_threads()}", flush=True)
    runs = {
        "decode": lambda: run_decode_steps(model, args.quantization),
        "prefill": lambda: run_prefill_steps(model, args.quantization),
        "linears": lambda: run_linears(model),
        "native": lambda: run_native_vs_previous(model),
        "ceiling": lambda: run_ceiling(model, tokenizer, workload, args.slots, args.quantization),
        "engine": lambda: run_engine(model, tokenizer, workload, args.slots, args.budget,
                                     quantization=args.quantization),
        "request": lambda: run_engine(model, tokenizer, workload, args.slots, args.budget, "request",
                                      args.quantization),
        "hf-cb": lambda: run_hf_continuous(model, tokenizer, workload, args.slots, args.budget),
        "static": lambda: run_static(model, tokenizer, workload, args.slots),
    }
    match_workload = make_workload(args.match, "fixed:1", "dataset", args.seed)
    if args.match:
        runs["match"] = lambda: run_match(model, tokenizer, match_workload, args.slots, 40, args.quantization)
    for variant in args.vs:  # the same runs in float32, or with int8 weights, for the ratios
        v_model = load_model(args.model, device, torch.float32)[0] if variant == "float32" else model
        v_quant = "int8" if variant == "int8" else "none"
        run_engine(v_model, tokenizer, workload[: args.slots], args.slots, args.budget, quantization=v_quant)  # warm-up
        runs[f"ceiling-{variant}"] = lambda m=v_model, q=v_quant: run_ceiling(m, tokenizer, workload, args.slots, q)
        runs[f"engine-{variant}"] = lambda m=v_model, q=v_quant: run_engine(m, tokenizer, workload, args.slots,
                                                                           args.budget, quantization=q)
        if args.match:
            runs[f"match-{variant}"] = lambda m=v_model, q=v_quant: run_match(m, tokenizer, match_workload,
                                                                             args.slots, 40, q)
    results = {}
    opt_in = {"linears", "native"}  # the kernel's own figures: asked for by name
    runs = {name: run for name, run in runs.items()
            if name not in args.skip and (name in args.only or name.partition("-")[0] in args.only
                                          or (not args.only and name not in opt_in))}
    if {"engine", "request"} & set(runs):
        run_engine(model, tokenizer, workload[: args.slots], args.slots, args.budget,
                   quantization=args.quantization)  # warm-up
    for name, run in runs.items():
        try:
            results[name] = run()
        except Exception as exc:  # report and go on: one failing baseline must not hide the others
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        r = results[name]
        if "error" in r:
            print(f"{name:8s} {r['error']}", flush=True)
        elif name == "decode":
            print_decode_steps(r)
        elif name == "prefill":
            print_prefill_steps(r)
        elif name == "linears":
            print_linears(r)
        elif name == "native":
            print_native_vs_previous(r)
        elif name.startswith("match"):
            print(f"{name:8s} {r['identical']}/{r['prompts']} greedy answers ({r['tokens']} tokens) token-identical "
                  f"to unbatched generate; mean common prefix {r['mean_common_prefix']:.1f} tokens", flush=True)
        else:
            print(f"{name:8s} {r['tokens_per_s']:8.1f} tok/s  {r['tokens']:6d} tokens in {r['seconds']:6.1f} s",
                  flush=True)
    engine = results.get("engine", {})
    if "tokens_per_s" in engine:
        print("ratios (engine / other):")
        for name, r in results.items():
            if name != "engine" and not name.startswith("ceiling-") and "tokens_per_s" in r:
                print(f"  engine / {name:8s} = {engine['tokens_per_s'] / r['tokens_per_s']:.2f}")
        if engine.get("tokens_per_s_while_waiting") and "tokens_per_s" in results.get("ceiling", {}):
            print(f"  steady state (requests waiting): engine {engine['tokens_per_s_while_waiting']:.1f} tok/s "
                  f"= {engine['tokens_per_s_while_waiting'] / results['ceiling']['tokens_per_s']:.2f} of the ceiling")
        for variant in args.vs:
            if "tokens_per_s" in results.get(f"ceiling-{variant}", {}) and "tokens_per_s" in results.get("ceiling", {}):
                print(f"  ceiling / ceiling-{variant} = "
                      f"{results['ceiling']['tokens_per_s'] / results[f'ceiling-{variant}']['tokens_per_s']:.2f}")
        print(f"waste {engine['waste']:.3f}, occupancy {engine['occupancy']:.3f}; slot utilisation "
              f"{engine['slot_utilisation_while_waiting'] or 0:.3f} while requests were waiting")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "dtype": dtype_name(dtype), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
