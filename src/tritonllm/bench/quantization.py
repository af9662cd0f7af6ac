"""`tritonllm-bench-quantization`: how far `quantization: int8` moves the model from float32, against
bf16's own distance, through the engine.

N chat prompts of the load test's dataset; float32 `model.generate` gives each a greedy answer of 40
tokens. Each variant of the engine (bf16; int8 with the native kernels, the int8 x int8 kernel where
the CPU has AVX512-VNNI; int8 with them off, torch's weight-only int8) then
- scores prompt + answer (prompt logprobs): the gap of each token's logprob to float32's, and the
  mean negative log-likelihood a token;
- answers the prompts greedily: how many answers are token-identical to float32's, and the mean
  common prefix.
A benchmark, not a test: minutes of CPU for the bundled model.
"""

from __future__ import annotations

import argparse

import torch

from tritonllm.bench.engine import make_workload
from tritonllm.bench.kernels import native_kernels
from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.model_loader import load_model
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.kernels import cpu_isa

ANSWER_TOKENS = 40


def float32_references(model, tokenizer, prompts: list[str]) -> list[tuple[int, list[int], list[float]]]:
    """Per prompt: its length in tokens, prompt + float32's greedy answer, and float32's logprob of
    each of those tokens after the first."""
    out = []
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            full = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  max_new_tokens=ANSWER_TOKENS, do_sample=False)[0].tolist()
            logprobs = model(torch.tensor([full])).logits[0].float().log_softmax(-1)
        out.append((len(ids), full, [logprobs[i - 1, full[i]].item() for i in range(1, len(full))]))
    return out


def measure(model, tokenizer, references, quantization: str, slots: int) -> dict:
    engine = LLMEngine(model, tokenizer, SchedulerConfig(max_num_seqs=slots, max_model_len=1024,
                                                         max_num_batched_tokens=256), quantization)
    scored = engine.generate([full for _, full, _ in references],
                             SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    gaps, nll = [], 0.0
    for (_, _, want), out in zip(references, scored):
        got = [t.logprob for t in out.prompt_logprobs[1:]]
        gaps += [abs(a - b) for a, b in zip(got, want)]
        nll -= sum(got)
    answers = engine.generate([full[:n] for n, full, _ in references],
                              SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0))
    identical, prefixes = 0, []
    for (n, full, _), answer in zip(references, answers):
        want, got = full[n:], answer.token_ids[:len(full) - n]
        prefixes.append(next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want))))
        identical += got == want
    gaps.sort()
    return {"mean_gap": sum(gaps) / len(gaps), "p99_gap": gaps[int(0.99 * len(gaps))], "max_gap": gaps[-1],
            "nll_per_token": nll / len(gaps), "identical": identical, "prompts": len(references),
            "mean_common_prefix": sum(prefixes) / len(prefixes)}


def run(model_name: str = "bundled", prompts: int = 48, slots: int = 8, seed: int = 0) -> dict:
    reference_model, tokenizer = load_model(model_name, "cpu", torch.float32)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             if tokenizer.chat_template else p for p, _ in make_workload(prompts, "fixed:1", "dataset", seed)]
    references = float32_references(reference_model, tokenizer, texts)
    want_nll = -sum(sum(lp) for _, _, lp in references) / sum(len(lp) for _, _, lp in references)
    model = load_model(model_name, "cpu", torch.bfloat16)[0]
    int8_native = "int8 x int8 (native)" if "avx512_vnni" in cpu_isa.cpu_flags() else "weight-only"
    variants = {"bf16": (True, "none"), f"int8, kernels on: {int8_native}": (True, "int8"),
                "int8, kernels off: weight-only (torch)": (False, "int8")}
    results = {"float32_nll_per_token": want_nll, "variants": {}}
    for name, (on, quantization) in variants.items():
        with native_kernels(on):
            results["variants"][name] = measure(model, tokenizer, references, quantization, slots)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonllm-bench-quantization", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bundled", help="bundled, tiny or a local HF directory")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args(argv)
    r = run(args.model, args.prompts, args.slots)
    print(f"against float32 (NLL {r['float32_nll_per_token']:.4f} a token), {args.prompts} prompts, "
          f"{ANSWER_TOKENS} greedy tokens each:")
    for name, v in r["variants"].items():
        print(f"  {name:42s} logprob gap mean {v['mean_gap']:.4f}, p99 {v['p99_gap']:.3f}, max {v['max_gap']:.3f}; "
              f"NLL {v['nll_per_token']:.4f}; greedy identical {v['identical']}/{v['prompts']}, "
              f"mean common prefix {v['mean_common_prefix']:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
