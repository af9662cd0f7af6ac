"""Constrained decoding: a request's `structured_outputs` (vLLM's name and keys) becomes a grammar,
and the grammar a mask over the vocabulary before every token is sampled.

Specs, exactly one key: `json` (a JSON schema, as an object or its text), `json_object` (true: any
JSON object), `regex`, `choice` (a list of strings), `grammar` (Lark, or GBNF as llama.cpp writes it).
llguidance compiles and runs them: a 3 MB wheel with no Python dependencies (xgrammar imports torch
and transformers and pulls the 286 MB `triton` wheel; outlines-core does no Lark).

Rules:
- JSON leaves a small model no room to loop (`strict_schema`): fixed separators and no free
  whitespace (given the freedom, it adds whitespace until max_tokens cuts the object off, seen with
  vLLM's defaults); an object's properties are the ones it lists unless it says otherwise
  (`additionalProperties` false, as xgrammar's strict mode, vLLM's default, reads a schema: with
  extra keys allowed the bundled model added key after key); an integer without bounds is a safe
  integer, |n| < 2**53 (unbounded, it wrote digits until cut off). A schema may still set its own
  whitespace in `x-guidance`.
- A spec is compiled and checked once (`GrammarCompiler`, cached by its text), in the thread that
  adds the request, never in the engine's step; a bad spec is refused there with a RequestError
  naming what is wrong. Each request gets its own copy of the compiled matcher (cheap).
- When the grammar is complete it allows only EOS, so the request ends with "stop"; max_tokens
  still ends it with "length".
- An answer closes before max_tokens would cut it off (`Closing`): once the tokens left are no more
  than the grammar's shortest way to its end (walked once per spec, from its start) plus a margin,
  the row takes EOS where the grammar allows it, else the first closing token the grammar allows
  (`"` before `]` before `}`: inside a string the model would pick `]` as text), else what the
  grammar allows as before. Without it the bundled model looped inside a string ("Luxury Luxury
  ...") until max_tokens cut the JSON off; vLLM has no such rule. Not with ignore_eos (the caller
  asked for max_tokens) nor before min_tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from tritonllm.errors import RequestError

FIELD = "structured_outputs"
KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled specs kept
CLOSER_ORDER = b'"]}'  # closing characters, the first preferred
CLOSING_MARGIN = 8  # tokens beyond the shortest end from the start: the open string or number's own close
ROLLOUT_LIMIT = 512  # steps of the shortest-end walk; a grammar with no end in reach closes from the start


def parse_spec(value: Any) -> tuple[str, str] | None:
    """(kind, canonical text) of a structured_outputs value, or None when it asks for nothing;
    RequestError when it is malformed. The text is the cache key."""
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise RequestError(f"{FIELD} is not valid JSON: {exc}", FIELD) from None
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"{FIELD} must be an object with one of the keys {', '.join(KINDS)}", FIELD)
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise RequestError(f"{FIELD} has unknown keys {unknown}; known: {', '.join(KINDS)}", FIELD)
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"{FIELD} must set exactly one of {', '.join(KINDS)}, got {sorted(given)}", FIELD)
    kind, spec = next(iter(given.items()))
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise RequestError(f"{FIELD}.json is not valid JSON: {exc}", FIELD) from None
        if not isinstance(spec, (dict, bool)):
            raise RequestError(f"{FIELD}.json must be a JSON schema (an object)", FIELD)
        return kind, json.dumps(spec)  # property order kept: the grammar follows it
    if kind == "json_object":
        if spec is not True:
            raise RequestError(f"{FIELD}.json_object must be true", FIELD)
        return kind, "true"
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise RequestError(f"{FIELD}.choice must be a non-empty list of non-empty strings", FIELD)
        return kind, json.dumps(spec)
    if not isinstance(spec, str) or not spec:
        raise RequestError(f"{FIELD}.{kind} must be a non-empty string", FIELD)
    return kind, spec


def grammar_of(kind: str, text: str) -> str:
    """The llguidance grammar of a parsed spec (not yet checked)."""
    from llguidance import LLMatcher, grammar_from

    if kind == "json":
        return LLMatcher.grammar_from_json_schema(strict_schema(json.loads(text)), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    try:
        return grammar_from("grammar", text)  # Lark as it is; GBNF converted to Lark
    except ValueError as exc:
        raise RequestError(f"{FIELD}.grammar is not a valid grammar: {exc}", FIELD) from None


SAFE_INTEGER = 2**53 - 1
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def strict_schema(schema):
    """A copy of the schema with what it leaves unsaid closed (see the module's rules)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if "integer" in kinds:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -SAFE_INTEGER
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = SAFE_INTEGER
    return out


class GrammarCompiler:
    """Compiles specs for one tokenizer, each distinct spec once; safe from any thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self._hf_tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._tokenizer = None  # llguidance's view of the vocabulary, made at the first spec (~0.5 s)
        self._closers = None  # with it: the tokens of closing characters only, the preferred first
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def start(self, spec: tuple[str, str]) -> tuple[Any, Closing]:
        """A fresh matcher for the spec, at its start, and how its answer closes; RequestError if the
        spec does not compile."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled[0].deep_copy(), compiled[1]
        template = self._compile(*spec)
        walk = Closing(0, self._closers, tuple(self._eos))
        closing = Closing(shortest_end(template, walk, self.vocab_size) + CLOSING_MARGIN, self._closers, walk.eos)
        with self._lock:
            self._compiled[spec] = (template, closing)
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return template.deep_copy(), closing

    def _compile(self, kind: str, text: str):
        from llguidance import LLMatcher

        try:
            grammar = grammar_of(kind, text)
        except RequestError:
            raise
        except ValueError as exc:  # not JSON where JSON was needed
            raise RequestError(f"{FIELD}.{kind} could not be compiled: {exc}", FIELD) from None
        tokenizer = self.llg_tokenizer()
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise RequestError(f"{FIELD}.{kind} is not valid: {messages[0].strip()}", FIELD)
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{FIELD}.{kind} is not valid: {matcher.get_error()}", FIELD)
        return matcher

    def llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=self._eos)
                self._closers = closing_tokens(tokenizer, self.vocab_size)
                self._tokenizer = tokenizer
            return self._tokenizer


def closing_tokens(tokenizer, vocab_size: int) -> np.ndarray:
    """Ids of the tokens made of closing characters only, ordered by their first character (as
    CLOSER_ORDER), then shortest first."""
    ranked = []
    for token in range(vocab_size):
        text = tokenizer.decode_bytes([token])
        if text and set(text) <= set(CLOSER_ORDER):
            ranked.append((CLOSER_ORDER.index(text[0]), len(text), token))
    return np.array([token for *_, token in sorted(ranked)], dtype=np.int64)


@dataclass(frozen=True)
class Closing:
    """How a spec's answer ends within max_tokens (the module's rule): from `reserve` tokens left,
    EOS where allowed, else the first allowed closing token."""
    reserve: int
    closers: np.ndarray  # token ids, the preferred first (closing_tokens)
    eos: tuple[int, ...]

    def choice(self, allowed: np.ndarray) -> int | None:
        """The closing token within what the grammar allows (a bool mask over the vocabulary), or
        None when it allows no closing token."""
        for token in self.eos:
            if token < len(allowed) and allowed[token]:
                return token
        closers = self.closers[allowed[self.closers]]
        return int(closers[0]) if len(closers) else None

    def narrow(self, allowed: np.ndarray) -> np.ndarray:
        """The mask narrowed to the closing choice, where there is one."""
        token = self.choice(allowed)
        if token is None:
            return allowed
        only = np.zeros_like(allowed)
        only[token] = True
        return only


def shortest_end(matcher, closing: Closing, vocab_size: int) -> int:
    """Tokens from the matcher's state to the grammar's end, taking the closing choice, else the lowest
    allowed token: an estimate, walked on a copy."""
    walk = matcher.deep_copy()
    for steps in range(ROLLOUT_LIMIT):
        if walk.is_accepting():
            return steps
        allowed = allowed_mask(walk, vocab_size)
        token = closing.choice(allowed)
        if token is None:
            others = np.flatnonzero(allowed)
            token = int(others[0]) if len(others) else None
        if token is None or not walk.consume_token(token):
            return steps
    return ROLLOUT_LIMIT


def allowed_mask(matcher, vocab_size: int) -> np.ndarray:
    """(vocab,) bool array: the tokens the matcher allows next."""
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[:vocab_size].astype(bool)


def allowed_tokens(matcher, vocab_size: int, closing: Closing | None = None):
    """(vocab,) bool tensor: the tokens the matcher allows next, narrowed to the closing choice when
    `closing` is given."""
    import torch  # here: the front parses specs without torch

    allowed = allowed_mask(matcher, vocab_size)
    return torch.from_numpy(closing.narrow(allowed) if closing is not None else allowed)
