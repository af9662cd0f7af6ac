"""Per-row sampling for one batch: every row keeps its own parameters and random generator.

Greedy rows take one batched argmax. Sampled rows draw from their own `torch.Generator`, so a
request with a seed gives the same text whatever else shares the batch.

Per row, in this order: penalties; log probabilities, when asked (from these logits: after the
penalties, before the min_tokens ban, the grammar's mask and temperature, so with no penalties they
are the model's own, as vLLM's default `raw_logprobs`); the grammar's mask (structured_output.py),
near max_tokens narrowed to its closing choice; the min_tokens ban, unless it would leave the grammar
nothing; temperature, top-k, top-p. Every step of it touches its own row only: a row's token does
not depend on its neighbours' constraints.
"""

from __future__ import annotations

import torch

from tritonllm.engine.sequence import Sequence, TokenLogprobs
from tritonllm.engine.structured_output import allowed_tokens


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Repetition penalty (HF/CTRL rule, prompt and output) and presence/frequency (vLLM rule, output)."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    if seq.output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(seq.output_ids, device=logits.device), minlength=logits.shape[-1])
        logits -= p.frequency_penalty * counts[: logits.shape[-1]] + p.presence_penalty * (counts > 0)[: logits.shape[-1]]
    return logits


def closes_now(seq: Sequence) -> bool:
    """A constrained row near max_tokens takes the grammar's closing choice (structured_output.py)."""
    p, made = seq.params, len(seq.output_ids)
    return (seq.closing is not None and not p.ignore_eos and made >= p.min_tokens
            and p.max_tokens - made <= seq.closing.reserve)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside top-k and outside the top-p nucleus to -inf (one row)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the best token stays.
        drop = cumulative - sorted_logits.softmax(-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = eos_token_ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One new token id per row of `logits` (float32, rows, vocab). A row whose request asked for
        logprobs gets them appended to its sequence's `logprobs`."""
        log_probs = {}
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.needs_penalties:
                apply_penalties(logits[row], seq)
            if p.logprobs is not None:
                log_probs[row] = torch.log_softmax(logits[row], -1)
            if seq.matcher is not None:
                closing = seq.closing if closes_now(seq) else None
                logits[row].masked_fill_(~allowed_tokens(seq.matcher, logits.shape[-1], closing), float("-inf"))
            if len(seq.output_ids) < p.min_tokens:
                banned = list((set() if p.ignore_eos else self.eos_token_ids) | set(p.stop_token_ids))
                if banned:
                    kept = logits[row, banned].clone()
                    logits[row, banned] = float("-inf")
                    if seq.matcher is not None and bool(torch.isneginf(logits[row]).all()):
                        logits[row, banned] = kept  # the grammar allows nothing else: it wins
        tokens = logits.argmax(-1).tolist()
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.greedy:
                continue
            row_logits = filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p)
            probs = row_logits.softmax(-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=seq.generator).item())
        for row, row_log_probs in log_probs.items():
            seqs[row].logprobs.append(token_logprobs(row_log_probs, tokens[row], seqs[row].params.logprobs))
        return tokens

    @staticmethod
    def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        return generator


def token_logprobs(log_probs: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The token's entry from its position's log probabilities (vocab,), with the `top` best."""
    best = torch.topk(log_probs, top) if top else None
    return TokenLogprobs(token, float(log_probs[token]),
                         list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else [])


def record_prompt_logprobs(seq: Sequence, start: int, logits) -> None:
    """Each row's logits (positions start, start + 1, ...) give the next prompt token's logprob."""
    for j in range(logits.shape[0]):
        target = start + j + 1
        if target == len(seq.prompt_logprobs) and target < seq.num_prompt:
            log_probs = torch.log_softmax(logits[j], -1)
            seq.prompt_logprobs.append(token_logprobs(log_probs, seq.prompt_ids[target], seq.params.prompt_logprobs))
