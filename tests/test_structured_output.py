"""Constrained decoding and log probabilities in the engine (tiny model, in process)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tritonllm.engine.llm_engine import LLMEngine
from tritonllm.engine.model_loader import load_model
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import SchedulerConfig
from tritonllm.engine.sampler import closes_now
from tritonllm.engine.sequence import Sequence
from tritonllm.engine.structured_output import CLOSING_MARGIN, SAFE_INTEGER, Closing, parse_spec, strict_schema
from tritonllm.errors import RequestError

CONFIG = {"max_num_seqs": 4, "max_model_len": 256, "max_num_batched_tokens": 128}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}


@pytest.fixture()
def engine(tiny_model):
    model, tokenizer = tiny_model
    return LLMEngine(model, tokenizer, SchedulerConfig(**CONFIG))


def test_specs_are_parsed_with_vllms_keys_and_refused_with_the_field_named():
    assert parse_spec({"regex": "a+"}) == ("regex", "a+")
    assert parse_spec('{"choice": ["x", "y"]}') == ("choice", '["x", "y"]')
    assert parse_spec({"json": json.dumps(SCHEMA)}) == ("json", json.dumps(SCHEMA))
    assert parse_spec(None) is None and parse_spec({"regex": None}) is None
    for bad in ({"regex": "a", "choice": ["a"]}, {"xml": "a"}, {"choice": []}, {"choice": [1]}, {"json": 5},
                {"json_object": "yes"}, {"grammar": ""}, "[1]", "{"):
        with pytest.raises(RequestError) as info:
            parse_spec(bad)
        assert info.value.field == "structured_outputs", bad


def test_a_strict_schema_closes_objects_and_bounds_integers_unless_told():
    strict = strict_schema({"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": "integer",
                            "maximum": 9}}, "$defs": {"D": {"type": "object", "properties": {}}}})
    assert strict["additionalProperties"] is False and strict["$defs"]["D"]["additionalProperties"] is False
    assert strict["properties"]["n"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert strict["properties"]["m"]["maximum"] == 9
    assert strict_schema({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"]


def test_constrained_answers_match_their_spec_and_end_with_the_grammar(engine):
    specs = [({"json": SCHEMA}, lambda t: set(json.loads(t)) == {"ok", "n"}),
             ({"regex": r"[a-c]{2,4}"}, lambda t: re.fullmatch(r"[a-c]{2,4}", t)),
             ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
             ({"grammar": 'start: "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    outs = engine.generate(["hello"] * len(specs), [SamplingParams(max_tokens=64, temperature=0, structured_outputs=s)
                                                     for s, _ in specs])
    for (spec, check), out in zip(specs, outs):  # the random model writes on inside strings: closing ends them
        assert out.finish_reason == "stop" and check(out.text), (spec, out.text)


def test_an_answer_closes_before_max_tokens_would_cut_it_off(engine):
    spec = {"json": {"type": "object", "properties": {"note": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "string"}}}, "required": ["note", "tags"]}}
    for max_tokens in (12, 24, 40):
        out = engine.generate(["hello"], SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=max_tokens,
                                                        structured_outputs=spec))[0]
        assert out.finish_reason == "stop" and len(out.token_ids) <= max_tokens, (max_tokens, out)
        assert set(json.loads(out.text)) == {"note", "tags"}, out.text
    _, closing = engine.grammars.start(parse_spec(spec))
    assert closing.reserve > CLOSING_MARGIN  # `{"note": "", "tags": []}` takes tokens


def test_closing_prefers_eos_then_the_first_closing_token_then_the_grammar():
    closing = Closing(reserve=10, closers=np.array([2, 1]), eos=(4,))
    assert closing.narrow(np.array([True, True, False, True, True])).tolist() == [False, False, False, False, True]
    assert closing.narrow(np.array([True, True, True, True, False])).tolist() == [False, False, True, False, False]
    assert closing.narrow(np.array([True, True, False, True, False])).tolist() == [False, True, False, False, False]
    assert closing.narrow(np.array([True, False, False, True, False])).tolist() == [True, False, False, True, False]


def test_closing_tokens_are_ranked_quote_bracket_brace(tiny_model):
    from tritonllm.engine.structured_output import GrammarCompiler

    _, tokenizer = tiny_model
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    _, closing = compiler.start(("regex", "a"))
    texts = [tokenizer.decode([t]) for t in closing.closers]
    assert texts[0] == '"' and set("".join(texts)) <= set('"]}') and texts.index("]") < texts.index("}")


def test_closing_waits_for_the_reserve_and_never_with_ignore_eos_or_before_min_tokens():
    closing = Closing(reserve=5, closers=np.array([1]), eos=(2,))

    def row(made, **params):
        seq = Sequence("r", [1], SamplingParams(max_tokens=20, **params))
        seq.output_ids, seq.closing = [0] * made, closing
        return closes_now(seq)

    assert [row(made) for made in (14, 15, 19)] == [False, True, True]
    assert not row(18, ignore_eos=True) and not row(16, min_tokens=17) and row(17, min_tokens=17)


def test_a_bad_spec_is_refused_when_added_never_in_a_step(engine):
    for spec in ({"regex": "[a-"}, {"json": {"type": "objec"}}, {"grammar": "start: missing"}):
        with pytest.raises(RequestError) as info:
            engine.add_request("hi", SamplingParams(structured_outputs=spec))
        assert info.value.field == "structured_outputs" and "not valid" in str(info.value)
    assert not engine.has_unfinished()


def test_logprobs_are_the_models_own_for_every_token(engine, tiny_model):
    model, tokenizer = tiny_model
    prompt = tokenizer.encode("The capital of France is")
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3,
                                                   prompt_logprobs=2))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits, -1)
    assert len(out.logprobs) == 6 and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0].token == prompt[0] and out.prompt_logprobs[0].logprob is None
    for i, entry in enumerate(out.logprobs):
        row = expected[len(prompt) - 1 + i]
        assert entry.token == out.token_ids[i] and abs(entry.logprob - float(row[entry.token])) < 1e-3
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token  # greedy: the best one
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry.token == prompt[position] and len(entry.top) == 2
        assert abs(entry.logprob - float(expected[position - 1][prompt[position]])) < 1e-3


def test_an_unconstrained_answer_is_bit_identical_beside_constrained_neighbours():
    """In bfloat16, the dtype whose batch invariance the engine promises (test_batch_invariance.py)."""
    model, tokenizer = load_model("tiny", "cpu", torch.bfloat16)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    alone = LLMEngine(model, tokenizer, SchedulerConfig(**CONFIG)).generate(["Once upon a time"], plain)[0]
    engine = LLMEngine(model, tokenizer, SchedulerConfig(**CONFIG))
    mixed = engine.generate(["Once upon a time", "a", "b"], [
        plain, SamplingParams(max_tokens=12, temperature=0, structured_outputs={"json": SCHEMA}),
        SamplingParams(max_tokens=12, temperature=0.7, seed=3, structured_outputs={"regex": "[0-9]+"})])
    assert mixed[0].token_ids == alone.token_ids
    assert [e.logprob for e in mixed[0].logprobs] == [e.logprob for e in alone.logprobs]
