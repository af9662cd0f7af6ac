"""The per-row sampler on small fake logits: seeds, top-k, top-p, greedy, min_tokens, penalties."""

from __future__ import annotations

import random

import pytest
import torch

from tritonllm.engine.sampler import Sampler, apply_penalties, filter_top_k_top_p
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.sequence import Sequence

VOCAB = 40
EOS = 3


def make_seq(params: SamplingParams, prompt=(10, 11, 12), output=(), name="r") -> Sequence:
    seq = Sequence(name, list(prompt), params)
    seq.output_ids = list(output)
    seq.generator = None if params.greedy else Sampler.make_generator(params.seed, "cpu")
    return seq


def random_logits(rows: int, seed: int, vocab: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def sample_rounds(sampler: Sampler, seqs: list[Sequence], rounds: int, logit_seed: int) -> dict[str, list[int]]:
    """Sample `rounds` tokens for every sequence; row logits depend only on (round, request_id)."""
    out = {s.request_id: [] for s in seqs}
    for r in range(rounds):
        rows = [random_logits(1, logit_seed * 1000 + r * 31 + int(s.request_id.split("-")[-1]))[0] for s in seqs]
        tokens = sampler(torch.stack(rows), seqs)
        assert len(tokens) == len(seqs)
        for s, t in zip(seqs, tokens):
            assert isinstance(t, int) and 0 <= t < VOCAB
            out[s.request_id].append(t)
            s.output_ids.append(t)
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=123, max_tokens=100),
    SamplingParams(temperature=0.7, top_k=8, seed=99, max_tokens=100),
    SamplingParams(temperature=1.3, top_p=0.8, seed=5, max_tokens=100),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=2**40, repetition_penalty=1.3,
                   presence_penalty=0.5, frequency_penalty=0.2, max_tokens=100),
])
def test_same_seed_same_tokens_whatever_the_batch(params):
    sampler = Sampler({EOS})
    alone = sample_rounds(sampler, [make_seq(params, name="req-0")], 30, logit_seed=1)["req-0"]
    assert len(set(alone)) > 1, "degenerate: always the same token"

    rng = random.Random(7)
    for trial in range(3):
        others = []
        for i in range(1, rng.randint(2, 6)):
            kind = rng.choice(["greedy", "unseeded", "seeded"])
            p = {"greedy": SamplingParams(temperature=0, max_tokens=100),
                 "unseeded": SamplingParams(temperature=1.0, top_k=5, max_tokens=100),
                 "seeded": SamplingParams(temperature=0.8, seed=rng.randrange(10**6), max_tokens=100)}[kind]
            others.append(make_seq(p, name=f"req-{i}"))
        target = make_seq(params, name="req-0")
        batch = others[:]
        batch.insert(rng.randint(0, len(batch)), target)
        got = sample_rounds(sampler, batch, 30, logit_seed=1)["req-0"]
        assert got == alone, f"trial {trial}: batch position/composition changed a seeded request's tokens"


def test_different_seeds_differ():
    sampler = Sampler({EOS})
    a = sample_rounds(sampler, [make_seq(SamplingParams(seed=1, max_tokens=100), name="req-0")], 30, 4)["req-0"]
    b = sample_rounds(sampler, [make_seq(SamplingParams(seed=2, max_tokens=100), name="req-0")], 30, 4)["req-0"]
    assert a != b


def test_greedy_is_argmax():
    sampler = Sampler({EOS})
    logits = random_logits(16, seed=11)
    seqs = [make_seq(SamplingParams(temperature=0)) for _ in range(16)]
    assert sampler(logits.clone(), seqs) == logits.argmax(-1).tolist()


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    sampler = Sampler({EOS})
    logits = random_logits(8, seed=12)
    seqs = [make_seq(SamplingParams(temperature=0 if i % 2 else 1.0, seed=i)) for i in range(8)]
    tokens = sampler(logits.clone(), seqs)
    for i in range(1, 8, 2):
        assert tokens[i] == int(logits[i].argmax())


def test_top_k_never_leaves_the_top_k():
    sampler = Sampler({EOS})
    base = random_logits(1, seed=21, scale=1.0)[0]
    for k in (1, 2, 5, 17):
        allowed = set(torch.topk(base, k).indices.tolist())
        seqs = [make_seq(SamplingParams(temperature=2.0, top_k=k, seed=i)) for i in range(200)]
        seen = set()
        for _ in range(5):
            tokens = sampler(base.repeat(200, 1), seqs)
            seen.update(tokens)
        assert seen <= allowed, f"top_k={k} emitted {sorted(seen - allowed)}"
        assert seen == allowed, f"top_k={k}: only {len(seen)} of the {k} allowed tokens were ever drawn"


@pytest.mark.parametrize("top_k", [0, -1, VOCAB, VOCAB + 5])
def test_top_k_off(top_k):
    logits = random_logits(1, seed=22)[0]
    assert torch.equal(filter_top_k_top_p(logits.clone(), top_k, 1.0), logits)


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Smallest set of the most likely tokens whose probability reaches top_p."""
    probs = logits.softmax(-1).double()
    order = torch.argsort(probs, descending=True).tolist()
    chosen, total = [], 0.0
    for t in order:
        chosen.append(t)
        total += float(probs[t])
        if total >= top_p:
            break
    return set(chosen)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9])
def test_top_p_never_leaves_the_nucleus(top_p):
    sampler = Sampler({EOS})
    base = random_logits(1, seed=31, scale=1.5)[0]
    allowed = nucleus(base, top_p)
    assert len(allowed) < VOCAB
    seqs = [make_seq(SamplingParams(temperature=1.0, top_p=top_p, seed=1000 + i)) for i in range(200)]
    seen = set()
    for _ in range(5):
        seen.update(sampler(base.repeat(200, 1), seqs))
    assert seen <= allowed, f"top_p={top_p} emitted {sorted(seen - allowed)} outside nucleus {sorted(allowed)}"
    assert int(base.argmax()) in seen
    if len(allowed) <= 10:
        assert seen == allowed, "tokens of the nucleus were never drawn"


def test_top_p_applies_after_temperature():
    sampler = Sampler({EOS})
    base = random_logits(1, seed=32, scale=1.0)[0]
    temperature, top_p = 0.5, 0.7
    allowed = nucleus(base / temperature, top_p)
    seqs = [make_seq(SamplingParams(temperature=temperature, top_p=top_p, seed=i)) for i in range(300)]
    seen = set(sampler(base.repeat(300, 1), seqs))
    assert seen <= allowed


def test_top_k_and_top_p_together():
    base = random_logits(1, seed=33, scale=1.0)[0]
    out = filter_top_k_top_p(base.clone(), 6, 0.5)
    kept = set(torch.nonzero(out > float("-inf")).flatten().tolist())
    top6 = set(torch.topk(base, 6).indices.tolist())
    assert kept <= top6
    masked = base.masked_fill(~torch.isin(torch.arange(VOCAB), torch.tensor(sorted(top6))), float("-inf"))
    assert kept == nucleus(masked, 0.5)


def test_min_tokens_bans_eos_and_stop_token_ids():
    sampler = Sampler({EOS, 4})
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0
    logits[0, 4] = 49.0
    logits[0, 9] = 48.0  # a stop token id
    logits[0, 20] = 1.0
    for greedy in (True, False):
        for n_out in range(3):
            p = SamplingParams(temperature=0 if greedy else 1.0, min_tokens=3, stop_token_ids=[9], seed=n_out, max_tokens=10)
            seq = make_seq(p, output=[20] * n_out)
            for _ in range(20 if not greedy else 1):
                token = sampler(logits.clone(), [seq])[0]
                assert token not in (EOS, 4, 9), f"banned token {token} with {n_out} < min_tokens outputs"
        p = SamplingParams(temperature=0 if greedy else 1.0, min_tokens=3, seed=1, max_tokens=10)
        assert sampler(logits.clone(), [make_seq(p, output=[20] * 3)])[0] == EOS  # allowed from then on


def test_min_tokens_only_affects_its_own_row():
    sampler = Sampler({EOS})
    logits = torch.zeros(2, VOCAB)
    logits[:, EOS] = 10.0
    seqs = [make_seq(SamplingParams(temperature=0, min_tokens=2, max_tokens=5)),
            make_seq(SamplingParams(temperature=0, max_tokens=5))]
    tokens = sampler(logits, seqs)
    assert tokens[0] != EOS and tokens[1] == EOS


def test_repetition_penalty_direction():
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 0.5, 3.0])
    seq = make_seq(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2, 3])
    out = apply_penalties(logits.clone(), seq)
    # Seen tokens become less likely: positive logits shrink, negative ones grow more negative.
    assert torch.allclose(out[:4], torch.tensor([1.0, -4.0, 0.5, -2.0]))
    assert torch.equal(out[4:], logits[4:])  # unseen untouched
    # A penalty below 1 favours seen tokens.
    out = apply_penalties(logits.clone(), make_seq(SamplingParams(repetition_penalty=0.5), prompt=[0, 1], output=[]))
    assert out[0] > logits[0] and out[1] > logits[1]


def test_presence_and_frequency_penalty_direction():
    logits = random_logits(1, seed=41)[0]
    out_ids = [5, 5, 5, 7]
    seq = make_seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[1, 2], output=out_ids)
    out = apply_penalties(logits.clone(), seq)
    assert out[5] == pytest.approx(float(logits[5]) - 0.5 - 3 * 0.25)
    assert out[7] == pytest.approx(float(logits[7]) - 0.5 - 0.25)
    untouched = [i for i in range(VOCAB) if i not in (5, 7)]
    assert torch.equal(out[untouched], logits[untouched]), "prompt tokens and unseen tokens must not change"
    # Negative penalties encourage repeats.
    seq = make_seq(SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), prompt=[1], output=out_ids)
    out = apply_penalties(logits.clone(), seq)
    assert out[5] > logits[5] and out[7] > logits[7] and out[5] - logits[5] > out[7] - logits[7]


def test_penalties_change_greedy_choice_through_the_sampler():
    sampler = Sampler({EOS})
    logits = torch.zeros(1, VOCAB)
    logits[0, 8] = 2.0
    logits[0, 9] = 1.5
    plain = make_seq(SamplingParams(temperature=0), output=[8])
    assert sampler(logits.clone(), [plain]) == [8]
    rep = make_seq(SamplingParams(temperature=0, repetition_penalty=2.0), output=[8])
    assert sampler(logits.clone(), [rep]) == [9]
    pres = make_seq(SamplingParams(temperature=0, presence_penalty=1.0), output=[8])
    assert sampler(logits.clone(), [pres]) == [9]
    freq = make_seq(SamplingParams(temperature=0, frequency_penalty=0.2), output=[8, 8, 8])
    assert sampler(logits.clone(), [freq]) == [9]
    freq_once = make_seq(SamplingParams(temperature=0, frequency_penalty=0.2), output=[8])
    assert sampler(logits.clone(), [freq_once]) == [8]
    # Penalties of one row do not leak into another row.
    both = torch.cat([logits, logits])
    assert sampler(both, [rep, plain]) == [9, 8]


def test_temperature_sharpens():
    sampler = Sampler({EOS})
    base = random_logits(1, seed=51, scale=1.0)[0]
    top = int(base.argmax())

    def share(temperature):
        seqs = [make_seq(SamplingParams(temperature=temperature, seed=i)) for i in range(400)]
        tokens = sampler(base.repeat(400, 1), seqs)
        return sum(t == top for t in tokens) / len(tokens)

    assert share(0.1) > share(1.0) > share(5.0)
