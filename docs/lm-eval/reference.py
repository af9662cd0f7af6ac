"""Reference accuracy: the bundled model's own log-likelihood of each choice (HF forward, float32)."""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tritonllm.model_files import bundled_dir
tok = AutoTokenizer.from_pretrained(bundled_dir()); model = AutoModelForCausalLM.from_pretrained(bundled_dir(), torch_dtype=torch.float32)
correct = 0; rows = [json.loads(l) for l in open("docs/lm-eval/tiny_facts.jsonl")]
for r in rows:
    ctx = f"Question: {r['question']}\nAnswer:"
    scores = []
    for c in r["choices"]:
        ctx_ids = tok.encode(ctx); full = tok.encode(ctx + " " + c)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), -1)
        scores.append(sum(float(lp[i - 1, full[i]]) for i in range(len(ctx_ids), len(full))))
    correct += scores.index(max(scores)) == r["answer"]
print(json.dumps({"acc": correct / len(rows), "correct": correct, "n": len(rows)}))
